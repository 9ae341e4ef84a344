"""The engine: weights, tokenizer, decoder model, Engine and Session, planner, snapshots."""

"""`kvchat bench`: speed, retrieval (passkey, needles in prose), snapshots, tokenizing and the
GPU check, each a command that prints numbers and writes JSON."""

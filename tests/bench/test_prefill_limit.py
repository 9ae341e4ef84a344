"""`kvchat bench prefill` at a small size, with the real model: every projection of every chunk
is counted, the parts add up to the prefill, and the engine is left as it was."""

from __future__ import annotations

from kvchat.bench.prefill_limit import LAYER_PROJECTIONS, run_prefill_bench
from kvchat.config import load_settings
from kvchat.core.engine import Engine

from .test_speed import SMALL


def test_the_parts_of_a_prefill_add_up_and_every_projection_is_counted(monkeypatch):
    engines: list[Engine] = []
    load = Engine.load

    def keep(*args, **kwargs):
        engines.append(load(*args, **kwargs))
        return engines[-1]

    monkeypatch.setattr(Engine, "load", keep)
    lines: list[str] = []
    result = run_prefill_bench(load_settings(overrides=SMALL).settings, [300], None, lines.append)
    (run,) = result["runs"]
    engine = engines[0]
    cfg = engine.config
    assert "float32" in result["peak_flops"]
    assert result["peak"] == max(
        r for rates in result["peak_flops"].values() for r in rates.values()
    )
    # 2 FLOPs per token, input and output feature of each of a layer's four projections.
    per_token = sum(k * n for k, n in result["projection_shapes"])
    parts = run["parts"]
    assert parts["projections"]["flops"] == 2 * run["context"] * cfg.num_layers * per_token
    assert abs(sum(p["seconds"] for p in parts.values()) - run["prefill_seconds"]) < 1e-6
    assert all(p["seconds"] >= 0 for p in parts.values())
    assert parts["attention_pass"]["flops"] > 0 and run["tok_s_at_peak"] > 0
    # The engine's own projections and cache methods are back in place.
    for layer in engine.model.layers:
        assert not any(
            type(getattr(layer, name)).__name__ == "_TimedLinear" for name in LAYER_PROJECTIONS
        )
    assert any("tok/s" in line for line in lines)

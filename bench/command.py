"""`kvchat bench WHAT`: runs the chosen benchmark with the command line's options."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvchat.config import Settings

from .baselines import BaselineMissingError, BaselineName
from .gpu import GpuRequiredError
from .loopback_http import ServeBenchError
from .prose import ProseMissingError
from .ruler.data import RulerDataMissingError

# Bad input or an unsuitable machine for a benchmark: one line and exit code 2.
BENCH_ERRORS: tuple[type[Exception], ...] = (
    BaselineMissingError,
    GpuRequiredError,
    ProseMissingError,
    RulerDataMissingError,
    ServeBenchError,
)


def run_bench(
    args: argparse.Namespace,
    settings: Settings,
    on_prefill: Callable[[int, int], None],
    log: Callable[[str], None],
) -> dict:
    """The result of `kvchat bench args.what`, ready to print as JSON."""
    if args.what == "speed":
        from .speed import run_speed_bench

        skip = {BaselineName.TRANSFORMERS} if args.no_transformers else set()
        return run_speed_bench(
            settings,
            args.contexts or [1024, 4096, 8192],
            model_spec=args.model,
            decode_tokens=args.decode_tokens,
            baselines=[b for b in args.baseline if b not in skip],
            compare_dense=args.compare_dense,
            log=log,
        )
    if args.what == "prefill":
        from .prefill_limit import run_prefill_bench

        return run_prefill_bench(settings, args.contexts or [8192], args.model, log)
    if args.what == "snapshot":
        from .snapshot import run_snapshot_bench

        return run_snapshot_bench(
            settings, args.tokens or 32 * 1024, model_spec=args.model, log=log
        )
    if args.what == "passkey":
        from .passkey import run_passkey_bench

        return run_passkey_bench(
            settings,
            args.lengths,
            5 if args.depths is None else args.depths,
            trials=args.trials or 1,
            model_spec=args.model,
            compare_dense=args.compare_dense,
            on_progress=on_prefill,
            seed=args.seed,
        )
    if args.what == "niah":
        from .needles import TaskSpec
        from .niah import DEFAULT_DEPTHS, run_niah_bench
        from .prose import load_prose

        return run_niah_bench(
            settings,
            TaskSpec(args.task, args.needle),
            args.lengths,
            DEFAULT_DEPTHS if args.depths is None else args.depths,
            trials=args.trials or 2,
            model_spec=args.model,
            compare_dense=args.compare_dense,
            prose=load_prose(args.haystack),
            on_progress=on_prefill,
            seed=args.seed,
        )
    if args.what == "ruler":
        from .ruler.run import run_ruler_bench
        from .ruler.tasks import RulerTask

        return run_ruler_bench(
            settings,
            args.tasks or list(RulerTask),
            args.lengths,
            samples=args.trials or 5,
            model_spec=args.model,
            compare_dense=args.compare_dense,
            log=log,
            on_progress=on_prefill,
            seed=args.seed,
        )
    if args.what == "serve":
        from .serve_load import run_serve_bench, summary

        server_args = [f"--set={o}" for o in args.set or []]
        if args.config:
            server_args.append(f"--config={args.config}")
        if args.model:
            server_args.append(f"--model={args.model}")
        result = run_serve_bench(
            server_args, args.clients, args.decode_tokens, log, hostile=args.hostile
        )
        for line in summary(result):
            log(line)
        return result
    if args.what == "gpu":
        from .gpu import run_gpu_bench

        return run_gpu_bench(
            settings,
            dry_run=args.dry_run,
            contexts=tuple(args.contexts) if args.contexts else None,
            decode_tokens=args.decode_tokens,
            log=log,
        )
    from kvchat.core.model_files import resolve_model_path
    from kvchat.core.tokenizer import load_tokenizer

    from .tokenizer_speed import tokenize_benchmark

    tokenizer = load_tokenizer(resolve_model_path(args.model or settings.model.path))
    return tokenize_benchmark(tokenizer, args.tokens or 1_000_000)

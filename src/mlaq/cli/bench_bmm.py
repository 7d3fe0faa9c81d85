"""``mlaq bench-bmm`` — time every BMM scheme and an absorbed MLA decode step (library: mlaq.bmm.bench)."""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer batches, contexts and repeats (< 1 min)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument(
        "--schemes", help="comma-separated scheme names (default: bf16 and every FP8 and MX scheme)"
    )
    parser.add_argument("--batches", help="comma-separated decode batch sizes (default 1,8,64)")
    parser.add_argument("--contexts", help="comma-separated context lengths (default 1024,8192,32768)")
    parser.add_argument("--reps", type=int, help="timed repeats per measurement, median reported")
    parser.add_argument(
        "--step-scheme", default="bf16", help="scheme of the decode step's BMMs (default bf16)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: stable numbers on a shared machine; 0 = torch's default)",
    )
    parser.add_argument(
        "--max-cache-gib", type=float, default=3.0, help="skip decode steps whose latent cache is larger"
    )


def _ints(text: str | None, default: tuple[int, ...], what: str) -> tuple[int, ...]:
    if text is None:
        return default
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--{what} takes comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--{what} takes comma-separated positive integers, got {text!r}")
    return values


def config_from_args(args: argparse.Namespace):  # -> BenchConfig (imported lazily: torch)
    from mlaq.bmm import scheme_names
    from mlaq.bmm.bench import SCHEMES, BenchConfig

    schemes = tuple(args.schemes.split(",")) if args.schemes else SCHEMES
    for name in (*schemes, args.step_scheme):
        if name not in scheme_names():
            raise ValueError(f"unknown BMM scheme {name!r}; known schemes: {', '.join(scheme_names())}")
    if args.reps is not None and args.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {args.reps}")
    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0 (0 = torch's default), got {args.threads}")
    quick = args.quick
    return BenchConfig(
        schemes=schemes,
        batches=_ints(args.batches, (1, 8, 64), "batches"),
        contexts=_ints(args.contexts, (1024, 8192) if quick else (1024, 8192, 32768), "contexts"),
        reps=args.reps or (1 if quick else 5),
        max_cache_gib=args.max_cache_gib,
        step_scheme=args.step_scheme,
        copy_mib=64 if quick else 256,
        threads=args.threads,
    )


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    from mlaq.bmm.bench import format_tables, run_bench

    result = run_bench(cfg)
    print(json.dumps(result, indent=1) if args.json else format_tables(result))
    return 0

"""``mlaq audit CHECKPOINT`` — which layers' W_UK / W_UV lose how much under each scheme, reading only
kv_b_proj (byte-range reads from the safetensors headers and the index), and a ``--quantization-config``
that keeps the risky ones at the checkpoint's precision.
"""

from __future__ import annotations

import argparse

from mlaq.cli.explain import add_quantization_argument

DEFAULT_SCHEMES = "fp8_per_tensor,mxfp4"  # what MLAQ_FP8BMM / MLAQ_FP4BMM (vLLM's AITER flags) select


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint",
        metavar="CHECKPOINT",
        nargs="?",
        help="safetensors checkpoint directory (any size; default: the bundled mlaq-tiny-4k)",
    )
    parser.add_argument(
        "--schemes",
        default=DEFAULT_SCHEMES,
        metavar="A,B,...",
        help=f"BMM schemes to measure, comma-separated; the first ranks the layers (default {DEFAULT_SCHEMES}; "
        "e.g. fp8_per_tensor,fp8_per_block,mxfp4,mxfp8)",
    )
    parser.add_argument(
        "--quantization-config",
        metavar="JSON|@FILE",
        help="the config whose per-layer decision the report shows (as `mlaq explain`); default: flags only",
    )
    add_quantization_argument(parser)
    parser.add_argument(
        "--out", metavar="DIR", help="write report.md, report.json and error_by_layer.png into DIR"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="with --out: replace files of those names that mlaq did not write (by default refused)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object on stdout instead of the table"
    )
    parser.add_argument(
        "--suggest-config",
        nargs="?",
        const="",
        metavar="SCHEME",
        help="emit a --quantization-config (targets + ignore) applying SCHEME (default: the first of --schemes) "
        "to every layer whose weight error is at most --max-error, ignoring the rest",
    )
    parser.add_argument(
        "--max-error",
        metavar="X",
        help="largest relative RMS weight error (of W_UK and W_UV) a targeted layer may have: 0.05 or 5%%",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="layers audited at once (threads of one torch thread each; ~0.3 GB each for DeepSeek-V3; default: min(2, CPUs))",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    import json
    import os
    import sys

    from mlaq.audit import audit, format_table, parse_error, report_json, suggest_config, write_report
    from mlaq.audit.report import prepare_out
    from mlaq.bundled import model_or_default
    from mlaq.progress import make_progress
    from mlaq.settings import Settings

    args.checkpoint = model_or_default(args.checkpoint)

    schemes = tuple(s.strip() for s in args.schemes.split(",") if s.strip())
    if not schemes:
        raise ValueError("--schemes needs at least one scheme name, e.g. fp8_per_tensor,mxfp4")
    suggest = args.suggest_config is not None
    if suggest != (args.max_error is not None):
        raise ValueError(
            "--suggest-config and --max-error go together: e.g. --suggest-config mxfp4 --max-error 0.12"
        )
    max_error = parse_error(args.max_error) if suggest else 0.0
    if suggest and args.quantization is not None:
        raise ValueError(
            "--suggest-config writes targets that choose the absorbed BMMs (mlaq's meaning); drop --quantization "
            "online, or measure a vLLM online config with --quantization online --quantization-config JSON"
        )
    if suggest and args.suggest_config and args.suggest_config not in schemes:
        schemes = (*schemes, args.suggest_config)  # measure what we are asked to suggest
    settings = Settings.from_env()
    workers = args.workers if args.workers is not None else min(2, os.cpu_count() or 1)
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    if args.out:  # before reading anything: a bad --out costs nothing
        prepare_out(args.out, args.overwrite)
    record = audit(
        args.checkpoint,
        schemes,
        settings,
        args.quantization_config,
        args.quantization,
        progress=make_progress("audit", not args.no_progress and not args.json),
        workers=workers,
    )
    if suggest:
        record["suggested_config"] = suggest_config(record, args.suggest_config or schemes[0], max_error)
    if args.out:
        paths = write_report(record, args.out, overwrite=args.overwrite)
        print(f"mlaq audit: wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    if args.json:
        sys.stdout.write(report_json(record))
        return 0
    print(format_table(record))
    if suggest:
        sc = record["suggested_config"]
        print(
            f"\nsuggested --quantization-config ({sc['scheme']} on {len(sc['targeted_layers'])} layers with weight "
            f"error <= {100 * sc['max_error']:g} %, {len(sc['kept_layers'])} kept):"
        )
        print(json.dumps(sc["config"]))
        if args.out:
            print(
                f"check it: mlaq explain {args.checkpoint} --quantization-config @{args.out}/quantization-config.json"
            )
    return 0

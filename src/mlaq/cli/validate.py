"""``mlaq validate [MODEL]`` — measure what re-quantizing the absorbed MLA BMMs costs, against bf16.

Per scheme: per-layer attention error, teacher-forced KL / top-1 / ΔNLL by context position, greedy
divergence and repetition, MTP speculative-decoding acceptance; the fp32 noise floor beside them.
MODEL defaults to the bundled mlaq-tiny-4k checkpoint (DeepSeek-V3's MLA geometry, 4096-token context) and
the evaluation text to its held-out file (``heldout.txt``, Python source; ``heldout-prose.txt`` beside it is
English prose, for ``--eval-text``).
Heavy imports happen in ``run`` only.
"""

from __future__ import annotations

import argparse

from mlaq.cli import validate_shape
from mlaq.cli.explain import add_platform_arguments, add_quantization_argument, add_tp_argument
from mlaq.validate import defaults as d
from mlaq.validate.defaults import DEFAULT_SCHEMES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        metavar="MODEL",
        nargs="?",
        help="checkpoint directory or a bundled model's name (default: the bundled mlaq-tiny-4k; also mlaq-tiny-16k)",
    )
    parser.add_argument(
        "--schemes",
        nargs="+",
        metavar="SCHEME",
        help=f"BMM schemes to compare, space- or comma-separated (default: {','.join(DEFAULT_SCHEMES)}; "
        "none with --as-configured)",
    )
    parser.add_argument(
        "--as-configured",
        action="store_true",
        help="measure what the current settings (MLAQ_FP8BMM, MLAQ_FP4BMM) and --quantization-config do",
    )
    parser.add_argument(
        "--quantization-config",
        metavar="JSON|@FILE",
        help="explicit per-layer schemes for --as-configured: '{\"targets\": {PATTERN: SCHEME}}' (implies it)",
    )
    add_platform_arguments(parser)  # --platform / --engine-defaults: only with --as-configured
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=d.NUM_SPECULATIVE_TOKENS,
        metavar="K",
        help=f"MTP draft tokens per step (default {d.NUM_SPECULATIVE_TOKENS}; 0: plain greedy, no acceptance)",
    )
    parser.add_argument(
        "--precision",
        choices=["decode_only", "consistent", "absorbed"],
        default="decode_only",
        help="prefill: kv_b_proj as loaded (decode_only, as vLLM), the scheme's dequantized weights "
        "(consistent), or the scheme's two BMMs as in decode (absorbed)",
    )
    add_tp_argument(parser)
    add_quantization_argument(parser)
    validate_shape.add_arguments(parser)  # --eval-text, --context-len, --windows, ... (every source's)
    parser.add_argument(
        "--flip-rows",
        type=int,
        default=d.FLIP_ROWS,
        metavar="N",
        help="query rows per window and layer for the attention flip rate",
    )
    validate_shape.add_task_arguments(parser)
    parser.add_argument(
        "--fail-on",
        choices=["degraded", "inconclusive"],
        help="exit 1 when a scheme's verdict is degraded (or, with 'inconclusive', not ok)",
    )
    parser.add_argument(
        "--max-drop",
        type=float,
        default=0.05,
        metavar="X",
        help="accuracy drop a run must be able to detect for an 'ok' verdict (default 0.05)",
    )
    parser.add_argument(
        "--max-kl", type=float, default=0.01, metavar="NATS", help="mean KL above this is degraded (0.01)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="chooses windows, prompts and task samples (default 0)"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1; 0: torch's default)"
    )
    parser.add_argument("--out", metavar="DIR", help="write report.md, report.json and PNG plots into DIR")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an --out report file or a --record file that mlaq did not write (by default refused)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object on stdout instead of the table"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    from mlaq.cli import validate_server

    validate_server.add_arguments(parser)
    parser.add_argument(
        "--stream",
        action="store_true",
        help="read the checkpoint one layer (and one routed expert) at a time: models larger than memory; "
        "teacher-forced measurements only (no free generation, no MTP acceptance)",
    )
    parser.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="with --stream: the memory the run may use, e.g. 8GiB, 2GB, 512MiB (default 8GiB); planned "
        "before any weight is read, the peak resident set is reported",
    )


def _schemes(values: list[str] | None, as_configured: bool) -> tuple[str, ...]:
    if values is None:
        return () if as_configured else DEFAULT_SCHEMES
    return tuple(name.strip() for v in values for name in v.split(",") if name.strip())


def config_from_args(args: argparse.Namespace):  # -> ValidateConfig (imported lazily)
    from mlaq.bundled import model_or_default
    from mlaq.model.loading.checkpoint import check_weight_files
    from mlaq.policy.local_dir import require_local_dir
    from mlaq.settings import Settings
    from mlaq.validate.config import ValidateConfig, default_eval_text
    from mlaq.validate.variants import precision_of

    model = require_local_dir(model_or_default(args.model))
    if not (model / "config.json").is_file():
        raise FileNotFoundError(f"{model}: not a checkpoint directory (no config.json)")
    check_weight_files(model)  # the checkpoint before any other input
    as_configured = args.as_configured or args.quantization_config is not None
    if not as_configured and (args.platform is not None or args.engine_defaults != "mlaq"):
        raise ValueError(
            "--platform and --engine-defaults decide what --as-configured measures; add --as-configured"
        )
    eval_text = None if args.eval_text else default_eval_text(model)
    return ValidateConfig(
        model=model,
        shape=validate_shape.run_shape(args, eval_text),
        schemes=_schemes(args.schemes, as_configured),
        as_configured=as_configured,
        settings=Settings.from_env(platform=args.platform, engine=args.engine_defaults)
        if as_configured
        else Settings(),
        quantization_config=args.quantization_config,
        quantization=args.quantization,
        precision=precision_of(args.precision),
        tensor_parallel_size=args.tensor_parallel_size,
        num_speculative_tokens=args.num_speculative_tokens,
        flip_rows=args.flip_rows,
    )


def run(args: argparse.Namespace) -> int:
    """One run for every source: the source from the arguments, then measure, summarize and the tail."""
    import sys

    from mlaq.cli.validate_output import finish
    from mlaq.validate.progress import make_progress
    from mlaq.validate.report import prepare_out
    from mlaq.validate.runner import run as run_source
    from mlaq.validate.verdict import VerdictConfig

    if getattr(args, "server", None):
        from mlaq.cli.validate_server import source_from_args

        source = source_from_args(args)
    else:
        source = _local_source(args)
    out = prepare_out(args.out, args.overwrite) if args.out else None  # before measuring: costs nothing
    verdicts = VerdictConfig(max_drop=args.max_drop, max_kl=args.max_kl)
    try:
        report = run_source(source, make_progress(not args.no_progress), verdicts)
    except KeyboardInterrupt:
        print(
            "mlaq validate: interrupted; nothing was written (a previous report stays as it was)",
            file=sys.stderr,
        )
        return 130
    return finish(args, report, out)


def _local_source(args: argparse.Namespace):  # -> Source: the engine, or the checkpoint layer by layer
    import torch

    for flag in ("reference", "against", "record"):
        if getattr(args, flag, None):
            raise ValueError(f"--{flag} needs --server URL")
    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0, got {args.threads}")
    config = config_from_args(args)
    from mlaq.cli.generate import warn_drafts_unusable

    warn_drafts_unusable("validate", config.num_speculative_tokens, "--max-tokens", config.shape.max_tokens)
    if args.eval_text and not config.eval_text.is_file():
        raise FileNotFoundError(f"--eval-text {config.eval_text}: no such file")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_budget is not None and not args.stream:
        raise ValueError("--memory-budget applies to --stream; add --stream")
    if args.stream:
        from mlaq.validate.sources.stream import StreamSource
        from mlaq.validate.stream import StreamConfig

        return StreamSource(config, StreamConfig.parse(args.memory_budget))
    from mlaq.libc import keep_freed_memory
    from mlaq.validate.sources.engine import EngineSource

    keep_freed_memory()  # in memory: reuse freed pages (tens-of-MB temporaries page-faulted ~15 % of the CPU time)
    return EngineSource(config)

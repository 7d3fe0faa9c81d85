"""``mlaq explain [MODEL]`` — which BMM scheme every MLA layer's kv_b_proj gets, and why.

MODEL defaults to the bundled mlaq-tiny-4k checkpoint.

Reads only the checkpoint's config files (config.json, hf_quant_config.json) unless ``--check-weights``
(then it also reads every kv_b_proj weight and reports NaN/inf). Prints a table folding consecutive
identical layers into ranges, plus the settings used; ``--json`` prints exactly one JSON object
``{"model_type", "settings", "layers", ...}``. ``--platform`` decides for one GPU kind;
``--engine-defaults vllm-0.32`` shows what released vLLM 0.32 would run there, next to mlaq's decision;
``--engine-defaults sglang-0.5.23`` what released SGLang 0.5.23 would run, next to vLLM 0.32's and mlaq's.
"""

from __future__ import annotations

import argparse

PLATFORMS = ("rocm-gfx942", "rocm-gfx950", "cuda", "cpu")
ENGINES = ("mlaq", "vllm-0.32", "sglang-0.5.23")


def add_platform_arguments(parser: argparse.ArgumentParser) -> None:
    """``--platform`` and ``--engine-defaults``, shared with ``mlaq validate --as-configured``."""
    parser.add_argument(
        "--platform",
        choices=PLATFORMS,
        default=None,
        help="decide for this GPU kind: which AITER BMMs exist and the FP8 dtype (default: mlaq's CPU "
        "emulation, where every scheme exists)",
    )
    parser.add_argument(
        "--engine-defaults",
        choices=ENGINES,
        default="mlaq",
        help="whose rules decide: mlaq's policy (default), or released vLLM 0.32 with its defaults and your "
        "VLLM_ROCM_USE_AITER* variables, or released SGLang 0.5.23 with its defaults and your SGLANG_USE_AITER / "
        "SGLANG_USE_DEEPGEMM_BMM (needs --platform)",
    )


def add_quantization_argument(parser: argparse.ArgumentParser) -> None:
    """``--quantization online``: the config means what vLLM 0.32 makes of it (shared with validate)."""
    parser.add_argument(
        "--quantization",
        choices=["online"],
        default=None,
        help="as in vLLM: --quantization online --quantization-config JSON quantizes the kv_b_proj LINEAR "
        "(prefill and decode, vLLM's meaning); without it targets choose the absorbed BMMs (mlaq's meaning)",
    )


def add_tp_argument(parser: argparse.ArgumentParser) -> None:
    """``--tensor-parallel-size``, shared with ``mlaq validate``."""
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="vLLM's --tensor-parallel-size: each of N ranks holds num_heads/N heads of kv_b_proj, and the "
        "BMM weights' per-tensor scales are computed over each rank's shard (default 1)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        metavar="MODEL",
        nargs="?",
        help="checkpoint directory (config.json; weights not needed; default: the bundled mlaq-tiny-4k)",
    )
    parser.add_argument(
        "--quantization-config",
        metavar="JSON|@FILE|FILE",
        help='vLLM 0.32\'s config: \'{"targets": {PATTERN: SCHEME}, "ignore": [PATTERN]}\', @file.json or a path',
    )
    add_quantization_argument(parser)
    add_platform_arguments(parser)
    add_tp_argument(parser)
    parser.add_argument(
        "--check-weights",
        action="store_true",
        help="also read every kv_b_proj weight from the safetensors files and report NaN/inf",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def run(args: argparse.Namespace) -> int:
    import json

    from mlaq.bundled import model_or_default
    from mlaq.model.loading.kv_b_check import check_kv_b_weights, not_checked_note
    from mlaq.policy.explain import explain
    from mlaq.settings import Settings

    settings = Settings.from_env(platform=args.platform, engine=args.engine_defaults)
    model = model_or_default(args.model)
    from mlaq.policy.explicit import policy_config

    qc = policy_config(args.quantization_config, args.quantization)
    found = explain(model, settings, qc, args.tensor_parallel_size)
    weights = check_kv_b_weights(model, found.result) if args.check_weights else None
    if args.json:
        out = found.to_json()
        out["weights_checked"] = None if weights is None else weights.to_json()
        print(json.dumps(out, indent=2))
    else:
        print(found.text(model, not_checked_note() if weights is None else weights.text()))
    return 0 if weights is None or weights.ok else 1

"""``mlaq explain MODEL`` — which BMM scheme every MLA layer's kv_b_proj gets, and why.

Reads only the checkpoint's config files (config.json, hf_quant_config.json); no weights.
Prints a table folding consecutive identical layers into ranges, plus the settings used;
``--json`` prints exactly one JSON object ``{"model_type", "settings", "layers"}``.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", metavar="MODEL", help="checkpoint directory (config.json; weights not needed)"
    )
    parser.add_argument(
        "--quantization-config",
        metavar="JSON|@FILE",
        help='explicit per-layer choice: \'{"targets": {PATTERN: SCHEME}, "ignore": [PATTERN]}\' or @file.json',
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def run(args: argparse.Namespace) -> int:
    import json

    from mlaq.policy import decide_from_dir
    from mlaq.policy.report import format_explain
    from mlaq.settings import Settings

    result = decide_from_dir(args.model, Settings.from_env(), args.quantization_config, log=False)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(format_explain(result, args.model))
    return 0

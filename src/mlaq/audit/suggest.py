"""``--suggest-config``: a ``--quantization-config`` that re-quantizes only the layers an audit found safe.

Emits ``{"targets": {MODULE: SCHEME}, "ignore": [MODULE]}`` with exact module names: the part of the
schema that mlaq and vLLM's online quantization both accept, and unambiguous under either's pattern
matching. A layer is targeted when its larger relative RMS weight error (W_UK or W_UV) under the scheme
is at most ``max_error``; every other layer is ignored, i.e. keeps the checkpoint's own precision
(bf16 for a bf16 checkpoint).
"""

from __future__ import annotations

from typing import Any

from mlaq.audit.run import risk


def suggest_config(record: dict[str, Any], scheme: str, max_error: float) -> dict[str, Any]:
    """The config, and which layers it targets and keeps."""
    if scheme not in record["schemes"]:
        raise ValueError(
            f"--suggest-config {scheme}: the audit did not measure that scheme; add it to --schemes "
            f"(measured: {', '.join(record['schemes'])})"
        )
    if not max_error > 0:
        raise ValueError(
            f"--max-error must be a positive relative error (e.g. 0.05 or 5%), got {max_error!r}"
        )
    targeted = [layer for layer in record["layers"] if risk(layer, scheme) <= max_error]
    kept = [layer for layer in record["layers"] if risk(layer, scheme) > max_error]
    config = {
        "targets": {layer["module"]: scheme for layer in targeted},
        "ignore": [layer["module"] for layer in kept],
    }
    return {
        "scheme": scheme,
        "max_error": max_error,
        "targeted_layers": [layer["layer"] for layer in targeted],
        "kept_layers": [layer["layer"] for layer in kept],
        "config": config,
    }


def parse_error(text: str) -> float:
    """``0.05`` or ``5%`` -> 0.05."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise ValueError(
            f"--max-error {text!r} is not a number; give a relative error like 0.05 or 5%"
        ) from None
    if not 0 < value < 1e9:
        raise ValueError(f"--max-error must be a positive relative error (e.g. 0.05 or 5%), got {text!r}")
    return value

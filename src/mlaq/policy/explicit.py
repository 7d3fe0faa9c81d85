"""The user's explicit quantization config: vLLM 0.32's ``--quantization-config`` (JSON, @FILE or a path).

``{"targets": {PATTERN: SCHEME}, "ignore": [PATTERN]}`` — the same JSON a user passes to vLLM 0.32
(``--quantization online --quantization-config ...``), read with vLLM's rules (see
:mod:`mlaq.policy.vllm_online`):

- PATTERN: exact layer name, ``re:`` regex (``re.match``) or fnmatch glob, matched against the layer's
  own name ``model.layers.N.self_attn.kv_b_proj`` (not a module above it), as vLLM does.
- SCHEME: vLLM's online shorthands that define a linear spec (fp8_per_tensor, fp8_per_block,
  fp8_per_channel, mxfp8, mxfp4) or one of mlaq's MLA scheme names (bf16, fp32, fp8_per_head,
  mxfp4_w4a16, the ``_fnuz`` variants). mlaq also accepts ``{"weight": SCHEME, "activation": ACT}``.
- ``targets`` choose the scheme of kv_b_proj's absorbed BMMs (mlaq's meaning); ``ignore`` exempts a layer
  from every online re-quantization (it keeps the checkpoint's own format).
- With ``--quantization online`` (the flag vLLM 0.32 itself needs before it applies a
  ``--quantization-config``), ``targets`` mean what they mean in vLLM 0.32: the kv_b_proj LINEAR is
  quantized online to the vLLM shorthand (prefill and, through its dequantized weight, decode); the
  values must then be vLLM's shorthands (:mod:`mlaq.model.loading.online` emulates them).

Only kv_b_proj's absorbed BMMs are emulated: a targets pattern that also matches another linear
(q_b_proj, o_proj, ...), which vLLM would quantize too, is an error, and so are ``linear``/``moe``.
An ignore pattern may name any layer (vLLM lets it); it only matters where it matches a kv_b_proj.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mlaq.bmm.online_linear import check_scheme
from mlaq.policy.model_config import MlaModel, layer_ranges
from mlaq.policy.patterns import Pattern, parse_patterns
from mlaq.policy.vllm_online import VLLM_SHORTHANDS, check_keys, check_vllm_value, read_config_text

# activation spellings -> canonical activation precision
_ACTIVATIONS = MappingProxyType(
    {
        None: "bf16",
        "none": "bf16",
        "bf16": "bf16",
        "fp8": "fp8",
        "mxfp4": "mxfp4",
        "mxfp8": "mxfp8",
        "fp32": "fp32",
    }
)


def _combinations(schemes: Collection[str]) -> dict[tuple[str, str], str]:
    """(weight, activation) -> scheme, limited to the registered schemes."""
    combos = {
        ("mxfp4", "mxfp4"): "mxfp4",
        ("mxfp4", "bf16"): "mxfp4_w4a16",
        ("mxfp8", "mxfp8"): "mxfp8",
        ("bf16", "bf16"): "bf16",
        ("fp32", "fp32"): "fp32",
    }
    # every fp8 BMM scheme quantizes its activations to fp8 dynamically, as the engines' kernels do
    combos.update({(name, "fp8"): name for name in schemes if name.startswith("fp8_")})
    return {k: v for k, v in combos.items() if v in schemes}


def resolve_scheme(value: Any, where: str, schemes: Collection[str]) -> str:
    """A targets value -> one registered scheme name."""
    known = ", ".join(schemes)
    if isinstance(value, str):
        if value not in schemes:
            raise ValueError(f"{where}: unknown scheme {value!r}; known schemes: {known}")
        return value
    if not isinstance(value, Mapping) or set(value) - {"weight", "activation"} or "weight" not in value:
        raise ValueError(
            f"{where}: expected a scheme name or {{'weight': SCHEME, 'activation': ACT}}, got {value!r}"
        )
    weight, act = value["weight"], value.get("activation")
    if weight not in schemes:
        raise ValueError(f"{where}: unknown weight scheme {weight!r}; known schemes: {known}")
    act_key = act.lower() if isinstance(act, str) else act
    if act_key not in _ACTIVATIONS:
        accepted = "bf16, none, null, fp8, mxfp4, mxfp8, fp32"
        raise ValueError(f"{where}: unknown activation {act!r}; accepted: {accepted}")
    combos = _combinations(schemes)
    scheme = combos.get((weight, _ACTIVATIONS[act_key]))
    if scheme is None:
        implemented = "; ".join(f"weight={w} activation={a} -> {s}" for (w, a), s in combos.items())
        raise ValueError(
            f"{where}: no mlaq scheme implements weight {weight} with activation {act}; implemented: {implemented}"
        )
    return scheme


@dataclass(frozen=True)
class Target:
    pattern: Pattern
    scheme: str
    written: Any  # the value as the user wrote it, for reports


@dataclass(frozen=True)
class ExplicitConfig:
    """A validated-in-isolation explicit config; :func:`mlaq.policy.decide` checks it against a model."""

    targets: tuple[Target, ...] = ()
    ignore: tuple[Pattern, ...] = ()
    online: bool = False  # --quantization online: targets quantize the kv_b_proj linear (vLLM's meaning)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "targets": {t.pattern.text: t.written for t in self.targets},
            "ignore": [p.text for p in self.ignore],
        }
        if self.online:
            out["quantization"] = "online"
        return out

    def meaning(self) -> str:
        """What a targets entry quantizes, in explain's words."""
        if self.online:
            return "kv_b_proj linear (vLLM's meaning, --quantization online: prefill and decode)"
        return "absorbed BMMs W_UK / W_UV (mlaq's meaning; --quantization online gives vLLM's)"

    def describe(self) -> str:
        return json.dumps(self.to_json(), separators=(", ", ": "))


def parse_explicit(
    obj: Any, schemes: Collection[str], where: str = "--quantization-config", *, online: bool = False
) -> ExplicitConfig:
    """Validate a parsed JSON object (vLLM's keys; see :mod:`mlaq.policy.vllm_online`); ``online``: read
    it as vLLM 0.32 does under ``--quantization online`` (targets quantize the kv_b_proj linear)."""
    check_keys(obj, where)
    targets_obj = obj.get("targets") or {}
    for k, v in targets_obj.items():
        check_vllm_value(k, v, where, schemes)
        if online and not (isinstance(v, str) and VLLM_SHORTHANDS.get(v)):
            linear = ", ".join(s for s, lin in VLLM_SHORTHANDS.items() if lin)
            raise ValueError(
                f"{where}: targets[{k!r}] = {json.dumps(v)} is not a vLLM online shorthand ({linear}); with "
                "--quantization online targets quantize the kv_b_proj linear as vLLM does. mlaq's scheme names "
                "choose the absorbed BMMs: drop --quantization online"
            )
        if online:
            check_scheme(v)  # the schemes mlaq runs end to end under vLLM's meaning
    targets = tuple(
        Target(
            Pattern.parse(k, f"{where} targets key"),
            resolve_scheme(v, f"{where} targets[{k!r}]", schemes),
            v,
        )
        for k, v in targets_obj.items()
    )
    return ExplicitConfig(targets, parse_patterns(obj.get("ignore"), f"{where} ignore"), online)


def load_explicit(value: str, schemes: Collection[str], *, online: bool = False) -> ExplicitConfig:
    """Parse ``--quantization-config`` text: inline JSON, ``@path`` or a path to a JSON file."""
    obj, where = read_config_text(value)
    return parse_explicit(obj, schemes, where, online=online)


def policy_config(text: str | None, quantization: str | None) -> ExplicitConfig | str | None:
    """``--quantization-config`` as the policy reads it: under ``--quantization online``, vLLM's meaning."""
    if quantization is None:
        return text
    if quantization != "online":
        raise ValueError(
            f"--quantization {quantization!r}: mlaq reads only 'online' (vLLM's flag for a config)"
        )
    if text is None:
        raise ValueError(
            "--quantization online applies a --quantization-config (as in vLLM); add one, e.g. "
            '--quantization-config \'{"targets": {"re:.*kv_b_proj": "fp8_per_tensor"}}\''
        )
    from mlaq.bmm import scheme_names

    return load_explicit(text, scheme_names(), online=True)


@dataclass(frozen=True)
class ExplicitMatch:
    """What the explicit config says about one layer's kv_b_proj."""

    target: Target | None = None
    ignore: Pattern | None = None
    online: bool = False  # the target quantizes the kv_b_proj linear (vLLM's meaning)


def match_model(cfg: ExplicitConfig, model: MlaModel) -> tuple[ExplicitMatch, ...]:
    """Check ``cfg`` against the model's modules; one :class:`ExplicitMatch` per MLA layer.

    Patterns match a layer's own name (vLLM's is_equal_or_regex_match), never a module above it."""
    known = model.known_modules()
    kv_b = [model.kv_b_proj(i) for i in model.layer_indices]
    for t in cfg.targets:
        hits = [m for m in known if t.pattern.matches(m)]
        if not any(t.pattern.matches(m) for m in kv_b):
            shown = ", ".join(hits[:3]) + (", ..." if len(hits) > 3 else "") if hits else "no layer"
            raise ValueError(
                f"--quantization-config targets pattern {t.pattern.text!r} matches {shown} but no kv_b_proj "
                f"(mlaq knows layers {layer_ranges(model.layer_indices)}, e.g. {model.kv_b_proj(0)!r}); "
                "as in vLLM a pattern matches the layer's own name, not a module above it: use "
                "'re:.*kv_b_proj' or the full kv_b_proj name"
            )
        others = [m for m in hits if m not in kv_b and m.rsplit(".", 1)[-1].endswith("proj")]
        if others:
            raise ValueError(
                f"--quantization-config targets pattern {t.pattern.text!r} also matches {others[0]} "
                f"({len(others)} other linear layers), which vLLM would quantize too; mlaq emulates only "
                "kv_b_proj's absorbed BMMs: narrow the pattern to kv_b_proj (e.g. 're:.*kv_b_proj')"
            )
    matches: list[ExplicitMatch] = []
    for module in kv_b:
        ts = [t for t in cfg.targets if t.pattern.matches(module)]
        igs = [p for p in cfg.ignore if p.matches(module)]
        if len(ts) > 1:  # vllm/model_executor/layers/quantization/online/base.py
            raise ValueError(
                f"--quantization-config: Layer {module} matches multiple quantization_config.targets patterns: "
                f"{[t.pattern.text for t in ts]}. Each layer may match at most one target."
            )
        if ts and igs:
            raise ValueError(
                f"--quantization-config: Layer {module} matches both quantization_config.ignore and "
                f"quantization_config.targets ({[ts[0].pattern.text]}); a layer may not be referenced by both."
            )
        matches.append(ExplicitMatch(ts[0] if ts else None, igs[0] if igs else None, cfg.online))
    return tuple(matches)

"""The user's explicit quantization config: ``--quantization-config JSON`` or ``@file.json``.

``{"targets": {PATTERN: SCHEME | {"weight": SCHEME, "activation": ACT}}, "ignore": [PATTERN]}``

- PATTERN: exact module name, ``re:`` regex or shell glob (see :mod:`mlaq.policy.patterns`); a
  pattern that matches a module above kv_b_proj (``model.layers.3.self_attn``) covers it.
- SCHEME: a name from ``mlaq.bmm.scheme_names()``. ``{"weight", "activation"}`` names the weight
  scheme and the activation precision (``bf16``/``none``/null = unquantized, ``fp8``, ``mxfp4``,
  ``mxfp8``, ``fp32``); only combinations a scheme implements are accepted.
- ``targets`` re-quantize (or keep) kv_b_proj's absorbed BMMs with the given scheme; ``ignore``
  exempts a layer from every online re-quantization (it keeps the checkpoint's own format).

Only kv_b_proj's absorbed BMMs are decided by mlaq: a targets pattern must cover at least one
kv_b_proj (a pattern that matches only q_a_proj/o_proj/... is an error, so a typo cannot silently
do nothing); the other attention linears are never changed.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from mlaq.policy.model_config import MlaModel, layer_ranges
from mlaq.policy.patterns import Pattern, covering, parse_patterns

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

    def to_json(self) -> dict[str, Any]:
        return {
            "targets": {t.pattern.text: t.written for t in self.targets},
            "ignore": [p.text for p in self.ignore],
        }

    def describe(self) -> str:
        return json.dumps(self.to_json(), separators=(", ", ": "))


def parse_explicit(
    obj: Any, schemes: Collection[str], where: str = "--quantization-config"
) -> ExplicitConfig:
    """Validate a parsed JSON object."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where}: expected a JSON object with 'targets' and/or 'ignore', got {obj!r}")
    unknown = set(obj) - {"targets", "ignore"}
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; expected 'targets' and/or 'ignore'")
    targets_obj = obj.get("targets") or {}
    if not isinstance(targets_obj, Mapping):
        raise ValueError(f"{where}: 'targets' must be an object {{PATTERN: SCHEME}}, got {targets_obj!r}")
    targets = tuple(
        Target(
            Pattern.parse(k, f"{where} targets key"),
            resolve_scheme(v, f"{where} targets[{k!r}]", schemes),
            v,
        )
        for k, v in targets_obj.items()
    )
    return ExplicitConfig(targets, parse_patterns(obj.get("ignore"), f"{where} ignore"))


def load_explicit(value: str, schemes: Collection[str]) -> ExplicitConfig:
    """Parse ``--quantization-config`` text: inline JSON, or ``@path`` to a JSON file."""
    where = "--quantization-config"
    if value.startswith("@"):
        path = Path(value[1:])
        if not path.is_file():
            raise ValueError(f"{where} {value}: no such file")
        text, where = path.read_text(), f"{where} {value}"
    else:
        text = value
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc}); pass a JSON object or @file.json") from None
    return parse_explicit(obj, schemes, where)


@dataclass(frozen=True)
class ExplicitMatch:
    """What the explicit config says about one layer's kv_b_proj."""

    target: Target | None = None
    ignore: Pattern | None = None


def match_model(cfg: ExplicitConfig, model: MlaModel) -> tuple[ExplicitMatch, ...]:
    """Check ``cfg`` against the model's modules; one :class:`ExplicitMatch` per MLA layer."""
    known = model.known_modules()
    for kind, pattern in [("targets", t.pattern) for t in cfg.targets] + [("ignore", p) for p in cfg.ignore]:
        if not any(pattern.matches(m) for m in known):
            raise ValueError(
                f"--quantization-config {kind} pattern {pattern.text!r} matches no module of this model "
                f"(mlaq knows the MLA modules of layers {layer_ranges(model.layer_indices)}, e.g. "
                f"{model.kv_b_proj(0)!r}, {model.self_attn(0)!r})"
            )
    kv_b = [model.kv_b_proj(i) for i in model.layer_indices]
    for t in cfg.targets:
        if not any(t.pattern.covers(m) for m in kv_b):
            hits = [m for m in known if t.pattern.matches(m)]
            shown = ", ".join(hits[:3]) + (", ..." if len(hits) > 3 else "")
            raise ValueError(
                f"--quantization-config targets pattern {t.pattern.text!r} matches only {shown}: only "
                "kv_b_proj's absorbed BMMs can be targeted; match self_attn.kv_b_proj or a module above it"
            )
    matches: list[ExplicitMatch] = []
    multi: dict[tuple[str, ...], list[int]] = {}
    both: dict[tuple[str, str], list[int]] = {}
    for i, module in enumerate(kv_b):
        ts = [t for t in cfg.targets if t.pattern.covers(module)]
        igs = covering(cfg.ignore, module)
        if len(ts) > 1:
            multi.setdefault(tuple(t.pattern.text for t in ts), []).append(i)
        if ts and igs:
            both.setdefault((ts[0].pattern.text, igs[0].text), []).append(i)
        matches.append(ExplicitMatch(ts[0] if ts else None, igs[0] if igs else None))
    if multi:
        pats, layers = next(iter(multi.items()))
        raise ValueError(
            f"--quantization-config: kv_b_proj of layers {layer_ranges(layers)} is matched by more than one "
            f"targets pattern ({', '.join(map(repr, pats))}); each layer may match at most one"
        )
    if both:
        (t, ig), layers = next(iter(both.items()))
        raise ValueError(
            f"--quantization-config: kv_b_proj of layers {layer_ranges(layers)} is matched by both targets "
            f"pattern {t!r} and ignore pattern {ig!r}; a layer is either targeted or ignored"
        )
    return tuple(matches)

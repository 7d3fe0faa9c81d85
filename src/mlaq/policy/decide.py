"""The decision procedure, per kv_b_proj, in this order (first that applies wins):

1. explicit ``targets`` / ``ignore`` (rule ``targets`` / ``ignore``);
2. a checkpoint that stores kv_b_proj quantized keeps exactly that format (rule ``checkpoint``);
   vLLM's FP8 flag would re-quantize block FP8 to one per-tensor scale — mlaq does not;
3. ``MLAQ_FP4BMM`` (wins; needs a bf16/fp16 source) or ``MLAQ_FP8BMM`` re-quantize to ``mxfp4`` /
   ``fp8_per_tensor`` (rule ``flag``) — unless the checkpoint HAS a quantization config that leaves
   kv_b_proj unquantized (rule ``guard``: keep it), except Quark MXFP4 checkpoints of the
   DeepSeek-V3 family, which intend dynamic MXFP4 for what they exclude (rule ``family-opt-in``;
   as in the engine, the opt-in lifts the guard for whichever flag is on);
4. otherwise the checkpoint's precision (rule ``default``).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from mlaq.bmm import scheme_names
from mlaq.bmm.online_linear import check_platform, check_scheme
from mlaq.policy import platform, reasons
from mlaq.policy.checkpoint import CheckpointQuant, native_scheme
from mlaq.policy.detect import checkpoint_quant
from mlaq.policy.explicit import ExplicitConfig, ExplicitMatch, load_explicit, match_model
from mlaq.policy.model_config import MlaModel, layer_ranges, mla_model, read_checkpoint_dir
from mlaq.policy.result import LayerDecision, PolicyResult, Rule
from mlaq.policy.sglang0523 import decide_sglang_0523
from mlaq.policy.vllm032 import decide_vllm_032
from mlaq.settings import Engine, Settings

FP4_FLAG_SCHEME = "mxfp4"  # vLLM's AITER FP4 BMM: W4A4 MXFP4
FP8_FLAG_SCHEME = "fp8_per_tensor"  # vLLM's AITER FP8 BMM: one weight scale for the whole tensor
FP4_SOURCES = ("bf16", "fp16")


def _flag(source: str, settings: Settings) -> tuple[str | None, str]:
    """(scheme, variable) a flag asks for on an unquantized source and the platform runs, or (None, "").

    As vLLM's mla_attention.py: the FP4 BMM first (where it exists), else the FP8 BMM."""
    p = settings.platform
    if settings.fp4bmm and source in FP4_SOURCES and platform.aiter_fp4bmm(p):
        return FP4_FLAG_SCHEME, "MLAQ_FP4BMM"
    if settings.fp8bmm and platform.aiter_fp8bmm(p):
        return platform.fp8_scheme(FP8_FLAG_SCHEME, p), "MLAQ_FP8BMM"
    return None, ""


def _blocked(source: str, settings: Settings) -> str:
    """The flags that are on but name a kernel this platform lacks (``"MLAQ_FP4BMM=1"``...), or ``""``."""
    p = settings.platform
    off = []
    if settings.fp4bmm and source in FP4_SOURCES and not platform.aiter_fp4bmm(p):
        off.append("MLAQ_FP4BMM=1")
    if settings.fp8bmm and not platform.aiter_fp8bmm(p):
        off.append("MLAQ_FP8BMM=1")
    return " and ".join(off)


def _on_platform(native: str, stored_scheme: str | None, settings: Settings) -> str:
    """The stored format as the platform runs it: e4m3fn FP8 data converted to e4m3fnuz on gfx942."""
    if stored_scheme is not None and native == stored_scheme:
        return platform.fp8_scheme(native, settings.platform)
    return native


# A layer that cannot be decided: (kind, details). Equal problems are reported once, for all their layers.
Problem = tuple[str, tuple[str, ...]]


def _decide_layer(
    i: int,
    model: MlaModel,
    ckpt: CheckpointQuant,
    settings: Settings,
    match: ExplicitMatch,
    schemes: Collection[str],
) -> LayerDecision | Problem:
    """A decision, or a problem to report for a group of layers."""
    module = model.kv_b_proj(i)
    storage = ckpt.kv_b_proj(module, model.dtype)
    stored = storage.stored

    def done(scheme: str, rule: Rule, reason: str, pattern: str | None = None) -> LayerDecision:
        return LayerDecision(i, module, stored.name, scheme, rule, reason, model.is_mtp(i), stored, pattern)

    if match.target is not None and match.online:
        t = match.target
        check_scheme(t.written)
        check_platform(None if settings.platform is None else str(settings.platform))
        reason = reasons.online_linear(t.pattern.text, t.written, storage)
        return LayerDecision(
            i,
            module,
            stored.name,
            "bf16",
            Rule.TARGETS,
            reason,
            model.is_mtp(i),
            stored,
            t.pattern.text,
            t.written,
        )
    if match.target is not None:
        t = match.target
        where = f"--quantization-config targets[{t.pattern.text!r}]"
        run, note = platform.target_scheme(t.scheme, settings.platform, where)
        reason = reasons.targets(t.pattern.text, run, storage, ckpt.method)
        return done(run, Rule.TARGETS, reason.removesuffix(".") + note + ".", t.pattern.text)
    if not stored.known:
        return ("unknown", (ckpt.method,))
    native = native_scheme(storage, schemes)
    if native is None:
        return ("no-scheme", (stored.name, stored.detail, str(stored.scheme)))
    native = _on_platform(native, stored.scheme, settings)
    if match.ignore is not None:
        return done(native, Rule.IGNORE, reasons.ignore(match.ignore.text, storage), match.ignore.text)
    if stored.quantized:
        return done(native, Rule.CHECKPOINT, reasons.checkpoint(native, storage, settings))
    scheme, var = _flag(stored.name, settings)
    blocked = _blocked(stored.name, settings)
    if scheme is None and blocked:
        return done(native, Rule.PLATFORM, reasons.platform_blocked(native, storage, blocked, settings))
    if scheme is None:
        return done(native, Rule.DEFAULT, reasons.default(native, storage, ckpt.has_config, settings))
    guarded = ckpt.has_config and storage.left_unquantized
    opt_in = guarded and ckpt.family_opt_in(model.model_type)
    if guarded and not opt_in:
        return done(native, Rule.GUARD, reasons.guard(native, storage, ckpt.method, settings))
    if scheme not in schemes:
        return ("no-flag-scheme", (scheme, var))
    if opt_in:
        return done(scheme, Rule.FAMILY_OPT_IN, reasons.family(scheme, var, storage, model.model_type))
    reason = reasons.flag(scheme, var, storage, settings)
    if blocked:  # MLAQ_FP4BMM on gfx942: the FP8 BMM runs instead
        reason = f"{blocked} names a kernel {settings.platform} lacks; {reason[0].lower()}{reason[1:]}"
    return done(scheme, Rule.FLAG, reason)


def _raise_problems(problems: dict[Problem, list[int]], schemes: Collection[str]) -> None:
    (kind, detail), layers = next(iter(problems.items()))
    where = f"kv_b_proj of layers {layer_ranges(layers)}"
    example = '--quantization-config \'{"targets": {"re:.*kv_b_proj": "bf16"}}\''
    if kind == "unknown":
        raise ValueError(
            f"the checkpoint's quant_method {detail[0]!r} is not one mlaq reads (fp8, quark, compressed-tensors, "
            f"modelopt), so the stored precision of {where} is unknown; decide them explicitly, e.g. {example}"
        )
    if kind == "no-scheme":
        name, text, scheme = detail
        missing = "" if scheme == "None" else f" (its scheme {scheme} is not registered)"
        raise ValueError(
            f"the checkpoint stores {where} as {name} ({text}), and no mlaq BMM scheme runs that format "
            f"exactly{missing}; choose a scheme explicitly, e.g. {example}; known: {', '.join(schemes)}"
        )
    scheme, var = detail
    raise ValueError(f"{var}=1 asks for scheme {scheme}, which this mlaq build does not register")


def decide(
    model: MlaModel,
    checkpoint: CheckpointQuant,
    settings: Settings,
    explicit: ExplicitConfig | None = None,
    schemes: Collection[str] | None = None,
) -> PolicyResult:
    """Decide every MLA layer (MTP layers included). Pure: no logging, no environment."""
    names = tuple(scheme_names()) if schemes is None else tuple(schemes)
    if settings.engine is Engine.VLLM_032:
        return decide_vllm_032(model, checkpoint, settings, explicit, names)
    if settings.engine is Engine.SGLANG_0523:
        return decide_sglang_0523(model, checkpoint, settings, explicit, names)
    matches = (
        match_model(explicit, model) if explicit is not None else (ExplicitMatch(),) * model.num_mla_layers
    )
    decisions: list[LayerDecision] = []
    problems: dict[Problem, list[int]] = {}
    for i in model.layer_indices:
        out = _decide_layer(i, model, checkpoint, settings, matches[i], names)
        if isinstance(out, LayerDecision):
            decisions.append(out)
        else:
            problems.setdefault(out, []).append(i)
    if problems:
        _raise_problems(problems, names)
    return PolicyResult(model, checkpoint, settings, explicit, tuple(decisions))


def decide_from_dir(
    path: str | Path,
    settings: Settings,
    quant_config: ExplicitConfig | str | None = None,
    *,
    log: bool = True,
) -> PolicyResult:
    """Decide from a checkpoint directory's config files; ``quant_config`` may be the raw
    ``--quantization-config`` text. Logs the one-line summary on logger ``mlaq.policy`` unless ``log=False``."""
    files = read_checkpoint_dir(path)
    model = mla_model(files.config, files.layers_prefix)
    explicit = load_explicit(quant_config, scheme_names()) if isinstance(quant_config, str) else quant_config
    result = decide(model, checkpoint_quant(files), settings, explicit)
    if log:
        result.log()
    return result

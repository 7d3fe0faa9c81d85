"""What released SGLang 0.5.23 runs for each MLA layer's absorbed BMMs (``--engine-defaults sglang-0.5.23``).

Every rule below is read from the sglang 0.5.23 wheel (paths under ``sglang/``):

- srt/models/deepseek_common/deepseek_weight_loader.py ``post_load_weights`` builds w_kc / w_vc from the
  WHOLE kv_b_proj weight (DeepseekV2/V3/V32ForCausalLM, GlmMoeDsaForCausalLM, Glm4MoeLiteForCausalLM):
  FP8 with 128x128 blocks on CUDA is dequantized to bf16 (``block_quant_dequant``) unless
  SGLANG_USE_DEEPGEMM_BMM=1 on Hopper keeps the blocks for DeepGEMM; any other FP8 (other blocks, or
  off CUDA) is re-quantized to ONE scale (``block_quant_to_tensor_quant`` / ``channel_quant_to_tensor_quant``:
  ``input_to_float8`` off CUDA, e4m3fnuz with max 224 on gfx94x after ``normalize_e4m3fn_to_e4m3fnuz``).
  With SGLANG_USE_AITER=1 on gfx95 (``_use_aiter_gfx95``, srt/models/deepseek_common/utils.py): a bf16
  kv_b_proj of ``GlmMoeDsaForCausalLM`` is quantized to e4m3fn with one scale (``input_to_float8``), and a
  non-FP8 kv_b_proj of a Quark ``DeepseekV3ForCausalLM`` checkpoint to MXFP4 (``quark_post_load_weights``:
  ``dynamic_mxfp4_quant`` along K, W4A4 ``batched_gemm_afp4wfp4_pre_quant`` — the kernels of mlaq's mxfp4).
- MTP: the draft model's architecture is renamed ``...NextN`` (srt/configs/model_config.py), so neither
  architecture rule touches it; it is loaded only with ``--speculative-algorithm EAGLE`` / ``NEXTN``.
- The BMMs: srt/models/deepseek_common/attention_forward_methods/forward_mla_rocm.py on ROCm
  (``rocm_absorb_q_bmm`` / ``rocm_absorb_v_bmm``: uint8 -> AITER FP4; e4m3fn with AITER on gfx95 -> AITER's
  a8w8 Triton BMM; e4m3fnuz -> that kernel for W_UK only inside CUDA graphs, imported only when
  SGLANG_USE_AITER=1; else ``torch.bmm`` on the bf16-dequantized weight), forward_mla.py elsewhere
  (``bmm_fp8`` after ``per_tensor_quant_mla_fp8`` on CUDA; the bf16-dequantized weight on the CPU).
"""

from __future__ import annotations

from collections.abc import Collection

from mlaq.policy.checkpoint import CheckpointQuant, native_scheme
from mlaq.policy.explicit import ExplicitConfig
from mlaq.policy.model_config import MlaModel
from mlaq.policy.result import LayerDecision, PolicyResult, Rule, every_layer, require_platform
from mlaq.settings import Platform, Settings

LOADER = "deepseek_weight_loader.py post_load_weights"
ROCM_BMM = "forward_mla_rocm.py rocm_absorb_q_bmm / rocm_absorb_v_bmm"
ARCHITECTURES = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM",
    "GlmMoeDsaForCausalLM",
    "Glm4MoeLiteForCausalLM",
)
FP8_STORED = ("fp8_per_block", "fp8_per_channel", "fp8_per_tensor")
W8A16 = "fp8_per_tensor_w8a16_sglang"
AITER_FP8 = "fp8_per_tensor_sglang"


class SglangCrash(ValueError):
    """A configuration SGLang 0.5.23 cannot load or run."""


def _fp8_off_cuda(p: Platform, aiter: bool, where: str) -> tuple[str, str | None, Rule, str]:
    """(W_UV scheme, W_UK scheme if different, rule, reason) of an FP8 kv_b_proj re-quantized per tensor."""
    if p is Platform.ROCM_GFX950 and aiter:
        why = f"SGLANG_USE_AITER=1 on gfx950: AITER's a8w8 BMM, activations per token per 128 ({ROCM_BMM})"
        return AITER_FP8, None, Rule.FLAG, f"{where}; {why}."
    if p is Platform.ROCM_GFX950:
        why = f"SGLANG_USE_AITER unset (default): torch.bmm on the weight dequantized to bf16 ({ROCM_BMM})"
        return W8A16, None, Rule.DEFAULT, f"{where}; {why}."
    if p is Platform.ROCM_GFX942:
        if not aiter:
            raise SglangCrash(
                f"SGLang 0.5.23 on rocm-gfx942 with an FP8 kv_b_proj and SGLANG_USE_AITER unset crashes in its "
                f"first CUDA-graph capture: rocm_absorb_q_bmm calls AITER's a8w8 BMM for e4m3fnuz weights in "
                f"capture mode, but forward_mla_rocm.py imports it only under SGLANG_USE_AITER=1; set "
                f"SGLANG_USE_AITER=1, or serve with --disable-cuda-graph (then {W8A16}_fnuz runs both BMMs)"
            )
        why = (
            "in CUDA graphs (decode, the default) W_UK runs AITER's a8w8 BMM and W_UV torch.bmm on the "
            f"bf16-dequantized weight; eager steps (prefill, --disable-cuda-graph) run both that way ({ROCM_BMM})"
        )
        return f"{W8A16}_fnuz", f"{AITER_FP8}_fnuz", Rule.FLAG, f"{where} (e4m3fnuz, max 224); {why}."
    why = (
        "forward_mla.py on the CPU: torch.bmm on the weight dequantized to bf16 (the AMX backend not modeled)"
    )
    return W8A16, None, Rule.DEFAULT, f"{where}; {why}."


def _layer(
    i: int, model: MlaModel, ckpt: CheckpointQuant, s: Settings, schemes: Collection[str]
) -> LayerDecision:
    assert s.platform is not None and s.sglang is not None
    p, env = s.platform, s.sglang
    module = model.kv_b_proj(i)
    storage = ckpt.kv_b_proj(module, model.dtype)
    stored = storage.stored
    mtp = model.is_mtp(i)
    # the draft model's architecture is renamed ...NextN: the architecture rules below never match it
    arch = f"{model.architecture}NextN" if mtp else model.architecture
    gfx95_aiter = p is Platform.ROCM_GFX950 and env.aiter

    def done(scheme: str, rule: Rule, reason: str, uk: str | None = None) -> LayerDecision:
        return LayerDecision(i, module, stored.name, scheme, rule, reason, mtp, stored, engine_uk=uk)

    if not stored.known:
        raise ValueError(f"the checkpoint's quant_method {ckpt.method!r} is not one mlaq reads")
    if stored.name in FP8_STORED:
        if p is Platform.CUDA and stored.block_size == (128, 128):
            if env.deepgemm_bmm:
                return done(
                    "fp8_per_block",
                    Rule.FLAG,
                    "SGLANG_USE_DEEPGEMM_BMM=1: on Hopper DeepGEMM runs the checkpoint's 128x128 blocks "
                    f"(activation groups quantized by SGLang's own kernel, emulated as DeepSeek-V3's) ({LOADER}); "
                    "on Blackwell it is dequantized to bf16.",
                )
            return done(
                "bf16",
                Rule.DEFAULT,
                f"on CUDA 128x128 block FP8 is dequantized to bf16 for the absorbed BMMs (block_quant_dequant, {LOADER}).",
            )
        if p is Platform.CUDA:
            return done(
                "fp8_per_tensor_batch_sglang",
                Rule.DEFAULT,
                f"its {stored.detail} is re-quantized to one e4m3fn scale for the whole kv_b_proj (sgl-kernel's "
                f"scaled_fp8_quant, emulated as input_to_float8) ({LOADER}); bmm_fp8 quantizes the activations "
                "with ONE scale per batch (per_tensor_quant_mla_fp8, forward_mla.py).",
            )
        where = (
            f"its {stored.detail} is dequantized and re-quantized to one scale for the whole kv_b_proj "
            f"(input_to_float8, {LOADER})"
        )
        scheme, uk, rule, reason = _fp8_off_cuda(p, env.aiter, where)
        return done(scheme, rule, reason, uk)
    if stored.name == "mxfp4" or not stored.quantized:
        if gfx95_aiter and ckpt.method == "quark" and arch == "DeepseekV3ForCausalLM":
            return done(
                "mxfp4",
                Rule.FAMILY_OPT_IN,
                "SGLANG_USE_AITER=1 on gfx950, a Quark DeepseekV3ForCausalLM checkpoint: its non-FP8 kv_b_proj "
                f"is quantized to MXFP4 W4A4 (quark_post_load_weights, {LOADER}); no setting turns this off.",
            )
        if gfx95_aiter and arch == "GlmMoeDsaForCausalLM" and stored.name == "bf16":
            return done(
                AITER_FP8,
                Rule.FLAG,
                "SGLANG_USE_AITER=1 on gfx950, GlmMoeDsaForCausalLM: its bf16 kv_b_proj is quantized to e4m3fn "
                f"with one scale (input_to_float8, {LOADER}); AITER's a8w8 BMM ({ROCM_BMM}).",
            )
    if stored.quantized:
        raise SglangCrash(
            f"SGLang 0.5.23 has no absorbed-BMM path for a kv_b_proj stored as {stored.name} ({stored.detail}) "
            f"in {arch or 'this architecture'} on {p}: {LOADER} handles FP8, INT8, AWQ and unquantized weights "
            f"(and MXFP4 only for Quark DeepseekV3ForCausalLM with SGLANG_USE_AITER=1 on gfx950)"
        )
    mtp_note = " (the MTP draft: architecture renamed ...NextN, no architecture rule applies)" if mtp else ""
    native = native_scheme(storage, schemes) or "bf16"
    return done(native, Rule.DEFAULT, f"the {stored.name} weight runs as stored, torch.bmm{mtp_note}.")


def decide_sglang_0523(
    model: MlaModel,
    checkpoint: CheckpointQuant,
    settings: Settings,
    explicit: ExplicitConfig | None,
    schemes: Collection[str],
) -> PolicyResult:
    """Every MLA layer as SGLang 0.5.23 with its defaults (and the user's SGLANG_* variables) runs it."""
    require_platform("sglang-0.5.23", "SGLang", settings, settings.sglang)
    if explicit is not None:
        raise ValueError(
            "--engine-defaults sglang-0.5.23 takes no --quantization-config: SGLang 0.5.23 has no per-layer "
            "override of the absorbed BMMs"
        )
    if model.architecture not in ARCHITECTURES:
        raise ValueError(
            f"--engine-defaults sglang-0.5.23: architecture {model.architecture or '(none in config.json)'!r} "
            f"is not one whose MLA weight loading mlaq has read ({', '.join(ARCHITECTURES)})"
        )
    return every_layer(
        model, checkpoint, settings, explicit, lambda i: _layer(i, model, checkpoint, settings, schemes)
    )

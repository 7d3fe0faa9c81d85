"""The one seam the plugin opens in vLLM: ``MLAAttention.__init__`` is wrapped so that, after vLLM's own
constructor, each layer reads the plugin's setting. Without a setting the wrapper returns at once and
the layer is vLLM's, untouched. With one, the layer gets mlaq's decision: its two AITER BMM flags
(policy mode), or its ``process_weights_after_loading`` followed by the swap of W_UK_T / W_UV for
mlaq's emulated weights (emulate mode). What was done is recorded on the layer as ``layer.mlaq``.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from mlaq.bmm import get_scheme
from mlaq.integrations.vllm.compat import AMX_REFUSAL, check_version, platform_of
from mlaq.integrations.vllm.config import Mode, PluginConfig, Precision, read_config
from mlaq.integrations.vllm.emulate import consistent_kv_b, emulated
from mlaq.integrations.vllm.plan import Kernels, LayerAction, Plan, checkpoint_files, make_plan
from mlaq.integrations.vllm.prefill import absorbed_prefill, check_no_prior_context
from mlaq.settings import VllmPluginEnv

LOGGER = logging.getLogger("vllm.mlaq_plugin")  # under vLLM's logger: its format, in its log
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class _Plans:
    """The plan of each model this process builds (the target model and its MTP drafter share one),
    decided and logged once. Held by the installed wrapper, not by the module."""

    env: VllmPluginEnv
    by_model: dict[str, Plan] = field(default_factory=dict)

    def get(self, vllm_config: Any, config: PluginConfig) -> Plan:
        model = vllm_config.model_config
        key = f"{model.model}|{config}"
        if key not in self.by_model:
            from vllm._aiter_ops import rocm_aiter_ops
            from vllm.platforms import current_platform

            kernels = Kernels(
                platform_of(current_platform),
                bool(rocm_aiter_ops.is_fp8bmm_enabled()),
                bool(rocm_aiter_ops.is_fp4bmm_enabled()),
            )
            files = checkpoint_files(str(model.model), model.hf_config.to_dict())
            plan = make_plan(config, files, self.env, kernels)
            for line in plan.lines():
                LOGGER.info(line)
            self.by_model[key] = plan
        return self.by_model[key]


def layer_index(prefix: str) -> int:
    m = _LAYER.search(prefix)
    if m is None:
        raise ValueError(f"mlaq plugin: cannot read the layer index of MLA layer {prefix!r}")
    return int(m.group(1))


def install() -> None:
    """Wrap ``MLAAttention.__init__`` once per process (vLLM may call ``register`` more than once)."""
    import vllm
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    if getattr(MLAAttention.__init__, "mlaq_plugin", False):
        return
    env = VllmPluginEnv.from_env()
    if env.config is not None:  # a bad MLAQ_VLLM_PLUGIN fails here, in the first process, at start-up
        read_config(None, env.config)
        check_version(vllm.__version__)
    plans = _Plans(env)
    original = MLAAttention.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _configure(self, plans)

    __init__.mlaq_plugin = True  # type: ignore[attr-defined]
    MLAAttention.__init__ = __init__


def _configure(layer: Any, plans: _Plans) -> None:
    import vllm
    from vllm.config import get_current_vllm_config

    vllm_config = get_current_vllm_config()
    extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else None
    config = read_config(extra, plans.env.config)
    if config is None:
        return
    check_version(vllm.__version__)
    plan = plans.get(vllm_config, config)
    action = plan.actions[layer_index(layer.layer_name)]
    if config.mode is Mode.POLICY:
        _apply_policy(layer, action)
    elif action.online is not None:
        _apply_online(layer, action.online)
    elif action.emulate is not None:
        _apply_emulation(layer, action.emulate, config.precision)
        if config.precision is Precision.ABSORBED:
            _apply_absorbed_prefill(layer, vllm_config)
    layer.mlaq = action


def _apply_policy(layer: Any, action: LayerAction) -> None:
    """vLLM's two flags become mlaq's. The FP4 BMM keeps vLLM's own precondition (a bf16 kv_b_proj
    weight: its re-quantizer reads bf16), which mlaq's decision implies (its source must be unquantized)."""
    weight = getattr(layer.kv_b_proj, "weight", None)
    if action.fp4bmm and (weight is None or weight.dtype != torch.bfloat16):
        raise RuntimeError(
            f"mlaq plugin: {layer.layer_name}: mlaq decided mxfp4 but kv_b_proj's weight is "
            f"{None if weight is None else weight.dtype}, not bf16; AITER's FP4 BMM cannot take it"
        )
    layer.is_aiter_triton_fp8_bmm_enabled = action.fp8bmm
    layer.is_aiter_triton_fp4_bmm_enabled = action.fp4bmm


def _apply_emulation(layer: Any, scheme_name: str, precision: Precision) -> None:
    if layer.is_amx_bmm_enabled:
        raise RuntimeError("mlaq plugin: " + AMX_REFUSAL.format(layer=layer.layer_name))
    if layer.dcp_q_replicate or getattr(layer.impl, "dcp_world_size", 1) > 1:
        raise RuntimeError(
            f"mlaq plugin: {layer.layer_name}: decode context parallelism gathers W_UK_T across ranks, which "
            "mode emulate does not follow; run without --decode-context-parallel-size"
        )
    layer.is_aiter_triton_fp8_bmm_enabled = False  # the plain torch.bmm branch reads the weights we set
    layer.is_aiter_triton_fp4_bmm_enabled = False
    scheme = get_scheme(scheme_name)
    vllm_process = layer.process_weights_after_loading

    def process_weights_after_loading(act_dtype: torch.dtype) -> None:
        vllm_process(act_dtype)  # W_UK_T (N, P, L) and W_UV (N, L, V) from the dequantized kv_b_proj
        w_uk = emulated(scheme, layer.W_UK_T, f"{layer.layer_name} W_UK_T")
        w_uv = emulated(scheme, layer.W_UV, f"{layer.layer_name} W_UV")
        del layer.W_UK_T, layer.W_UV  # vLLM's bf16 copies
        layer.W_UK_T, layer.W_UV = w_uk, w_uv
        if precision is Precision.CONSISTENT:
            kv_b = layer.kv_b_proj.weight
            if not kv_b.dtype.is_floating_point or kv_b.element_size() < 2:
                raise RuntimeError(
                    f"mlaq plugin: {layer.layer_name}: precision consistent rewrites kv_b_proj's weight, which "
                    f"is stored {kv_b.dtype}; use precision decode_only for a quantized kv_b_proj"
                )
            kv_b.data.copy_(consistent_kv_b(w_uk, w_uv, kv_b.dtype))

    layer.process_weights_after_loading = process_weights_after_loading


def _apply_absorbed_prefill(layer: Any, vllm_config: Any) -> None:
    """Prefill's attention (``impl.forward_mha``) computed in absorbed form with the emulated BMMs."""
    check_no_prior_context(layer.layer_name, vllm_config)
    if layer.kv_cache_dtype != "auto":
        raise RuntimeError(
            f"mlaq plugin: {layer.layer_name}: precision absorbed attends over the new tokens' latent entries "
            f"in the model's dtype; this vLLM stores its cache as {layer.kv_cache_dtype}: run --kv-cache-dtype auto"
        )
    layer.impl.forward_mha = functools.partial(absorbed_prefill, layer)


def _apply_online(layer: Any, online: str) -> None:
    """vLLM's meaning of targets: kv_b_proj's linear quantized online (:mod:`mlaq.integrations.vllm.online`)."""
    from mlaq.integrations.vllm.online import apply_online

    apply_online(layer, online)

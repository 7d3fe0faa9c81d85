"""``load_model``: a checkpoint directory -> a ready :class:`DeepseekForCausalLM`.

Weights are read lazily, one tensor at a time (see checkpoint.py), dequantized exactly (weights.py) and
cast to the compute dtype. kv_b_proj additionally goes through the re-quantization policy: every MLA
layer's absorbed BMM weights are prepared with the scheme the policy decided, from the checkpoint's own
codes and scales when the decision says so (rule ``checkpoint``), and the decisions are kept on the model
(``model.bmm_decisions``), so ``mlaq explain`` on the directory and the loaded model agree.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import MappingProxyType

import torch
from torch import nn

from mlaq.bmm.tp import check_tp_size
from mlaq.model.config import ModelConfig
from mlaq.model.layers.deepseek import DeepseekForCausalLM
from mlaq.model.layers.mla_core import Precision
from mlaq.model.layers.moe import MoE
from mlaq.model.loading.checkpoint import SafetensorsCheckpoint, check_finite
from mlaq.model.loading.kv_b import apply_decision
from mlaq.model.loading.online import check_online_precision, check_platform, online_kv_b
from mlaq.model.loading.weights import (
    CheckpointQuant,
    CheckpointWeight,
    WeightFormat,
    read_linear,
    read_tensor,
)
from mlaq.policy import ExplicitConfig, decide_from_dir
from mlaq.settings import Settings, bound_onednn_caches

LOGGER = logging.getLogger("mlaq.model")
_DTYPES = MappingProxyType({"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32})
_FP32_PARAMS = ("e_score_correction_bias",)  # kept fp32 whatever the compute dtype (as transformers)


def checkpoint_dtype(cfg: ModelConfig) -> torch.dtype:
    """The dtype of the checkpoint's unquantized weights (config.json ``torch_dtype`` / ``dtype``)."""
    raw = cfg.hf.get("torch_dtype") or cfg.hf.get("dtype") or "bfloat16"
    if raw not in _DTYPES:
        raise ValueError(f"config.json: dtype {raw!r} is not supported; expected one of {sorted(_DTYPES)}")
    return _DTYPES[raw]


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    settings: Settings | None = None,
    quantization_config: ExplicitConfig | str | None = None,
    precision: Precision = Precision.DECODE_ONLY,
    load_mtp: bool | None = None,
    tensor_parallel_size: int = 1,
) -> DeepseekForCausalLM:
    """Load ``path`` (config.json + model.safetensors or a sharded index).

    dtype: compute dtype (default: the checkpoint's). settings: MLAQ_FP8BMM / MLAQ_FP4BMM (default: read
    from the environment). quantization_config: ``--quantization-config`` JSON text or parsed object.
    precision: what prefill computes with (DECODE_ONLY: the checkpoint's kv_b, as vLLM; CONSISTENT: the
    scheme's). load_mtp: None loads the MTP layers if the checkpoint stores them, True requires them.
    tensor_parallel_size: the BMM weights are re-quantized per rank's shard of the heads, as vLLM's
    ``--tensor-parallel-size`` runs them (:mod:`mlaq.bmm.tp`); the outputs are the ranks' concatenated.
    """
    bound_onednn_caches()  # before the process's first bf16 GEMM (mlaq.settings): no per-shape growth
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    check_tp_size(tensor_parallel_size, cfg.num_attention_heads)
    quant = CheckpointQuant.from_hf(cfg.hf, str(path / "config.json"))
    if quant.method is None and (path / "hf_quant_config.json").is_file():
        raise ValueError(
            f"{path / 'hf_quant_config.json'}: ModelOpt checkpoints (e.g. NVFP4) cannot be loaded; mlaq loads "
            "bf16/fp16/fp32, fp8, quark and compressed-tensors weights (`mlaq explain` reads this config)"
        )
    settings = Settings.from_env() if settings is None else settings
    dtype = checkpoint_dtype(cfg) if dtype is None else dtype
    with SafetensorsCheckpoint(path) as ckpt:  # validates the files before the policy reads the index
        policy = decide_from_dir(path, settings, quantization_config)
        n_mtp = _mtp_layers_present(cfg, ckpt, load_mtp)
        first_mtp = cfg.num_hidden_layers
        model = DeepseekForCausalLM(
            cfg,
            dtype=dtype,
            device="meta",  # no memory until each tensor is read
            num_mtp_layers=n_mtp,
            mtp_own_embed=n_mtp > 0 and ckpt.has(f"model.layers.{first_mtp}.embed_tokens.weight"),
            mtp_own_head=n_mtp > 0 and ckpt.has(f"model.layers.{first_mtp}.shared_head.head.weight"),
        )
        kv_b = _load_weights(model, ckpt, quant, dtype)
    # vLLM's meaning of targets: the kv_b_proj linear quantized online (--quantization online, or
    # --engine-defaults vllm-0.32's own reading of targets): its kernels and mlaq's --precision checked once
    online = {layer: d.online for layer in kv_b if (d := policy.for_layer(layer)).online is not None}
    if online:
        check_platform(None if settings.platform is None else str(settings.platform))
        check_online_precision(precision)
    for layer, scheme in sorted(online.items()):
        attn = model.model.layers[layer].self_attn
        kv_b[layer] = _online_kv_b(attn, kv_b[layer], scheme, dtype, tensor_parallel_size)
    for layer, stored in sorted(kv_b.items()):
        attn = model.model.layers[layer].self_attn
        apply_decision(attn, policy.for_layer(layer), stored, precision, tensor_parallel_size)
    model.bmm_decisions = policy.layers
    model.tensor_parallel_size = tensor_parallel_size
    model.policy = policy
    for module in model.modules():
        if isinstance(module, MoE):
            module.stack_experts()  # decode-sized batches run the routed experts as stacked GEMMs
    return model.eval()


def _online_kv_b(
    attn: nn.Module, stored: CheckpointWeight, online: str, dtype: torch.dtype, tp: int
) -> CheckpointWeight:
    """vLLM 0.32's online quantization of the kv_b_proj linear (``mlaq.model.loading.online``): prefill runs
    the online linear (activations quantized); its dequantized weight is kv_b_proj's and the BMMs' source."""
    if stored.format is not WeightFormat.DENSE:
        raise ValueError(
            f"{stored.name}: --quantization online re-quantizes a kv_b_proj the checkpoint stores as "
            f"{stored.format.value} (vLLM's requantization source), which mlaq does not emulate; target an "
            "unquantized kv_b_proj or drop --quantization online"
        )
    prefill, weight = online_kv_b(stored.codes, online, dtype, tp)  # weight: [N*(P+V), L], activation dtype
    _set(attn.kv_b_proj, "weight", weight)
    attn.kv_b_online = prefill
    return CheckpointWeight(stored.name, WeightFormat.DENSE, weight)


def _mtp_layers_present(cfg: ModelConfig, ckpt: SafetensorsCheckpoint, load_mtp: bool | None) -> int:
    n = cfg.num_nextn_predict_layers
    names = [f"model.layers.{cfg.num_hidden_layers + i}.eh_proj.weight" for i in range(n)]
    present = [ckpt.has(name) for name in names]
    if load_mtp is False or n == 0:
        return 0
    if all(present):
        return n
    if not any(present) and load_mtp is None:
        LOGGER.warning(
            "config.json declares %d MTP layer(s) but %s stores none (e.g. saved by transformers, which "
            "drops them); loading without MTP",
            n,
            ckpt.directory,
        )
        return 0
    missing = names[present.index(False)]
    raise ValueError(f"tensor {missing!r} of MTP layer is missing from the checkpoint in {ckpt.directory}")


def _load_weights(
    model: DeepseekForCausalLM, ckpt: SafetensorsCheckpoint, quant: CheckpointQuant, dtype: torch.dtype
) -> dict[int, CheckpointWeight]:
    """Fill every parameter of ``model`` (built on the meta device) from ``ckpt``; returns the stored
    kv_b_proj weight of each layer for the policy step."""
    kv_b: dict[int, CheckpointWeight] = {}
    tied = model.config.tie_word_embeddings and not ckpt.has("lm_head.weight")
    for name, module in model.named_modules():
        if tied and name == "lm_head":
            continue
        if isinstance(module, nn.Linear):
            stored = read_linear(ckpt, quant, name, tuple(module.weight.shape))
            weight = stored.dequantize()
            check_finite(weight, ckpt.where(f"{name}.weight"))
            _set(module, "weight", weight.to(dtype))
            if name.endswith("self_attn.kv_b_proj"):
                kv_b[int(name.split(".")[2])] = stored
            if module.bias is not None:
                _set(module, "bias", read_tensor(ckpt, f"{name}.bias", tuple(module.bias.shape)).to(dtype))
            continue
        for pname, param in list(module.named_parameters(recurse=False)):
            tensor = read_tensor(ckpt, f"{name}.{pname}", tuple(param.shape))
            _set(module, pname, tensor.float() if pname in _FP32_PARAMS else tensor.to(dtype))
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return kv_b


def _set(module: nn.Module, pname: str, tensor: torch.Tensor) -> None:
    module._parameters[pname] = nn.Parameter(tensor.contiguous(), requires_grad=False)

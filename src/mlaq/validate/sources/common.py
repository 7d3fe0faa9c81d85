"""What every source records the same way: versions, the model's geometry, the run's settings."""

from __future__ import annotations

import platform
import sys
from typing import Any

import torch

import mlaq
from mlaq.model.config import ModelConfig
from mlaq.validate.config import ValidateConfig, Variant
from mlaq.validate.metrics import BucketSums, PositionDivergence
from mlaq.validate.record import LayerRef, Totals
from mlaq.validate.text import EvalData


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def versions() -> dict[str, str]:
    out = {"mlaq": mlaq.__version__, "torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        import tokenizers

        out["tokenizers"] = tokenizers.__version__
    except ImportError:  # pragma: no cover - the tokenizer could not have loaded
        pass
    out["platform"] = platform.platform()
    out["machine"] = platform.machine()
    return out


def model_info(config: ValidateConfig, mc: ModelConfig, num_mtp_layers: int) -> dict[str, Any]:
    return {
        "path": str(config.model),
        "model_type": mc.model_type,
        "num_hidden_layers": mc.num_hidden_layers,
        "num_mtp_layers": num_mtp_layers,
        "num_attention_heads": mc.num_attention_heads,
        "kv_lora_rank": mc.kv_lora_rank,
        "qk_nope_head_dim": mc.qk_nope_head_dim,
        "qk_rope_head_dim": mc.qk_rope_head_dim,
        "v_head_dim": mc.v_head_dim,
        "max_position_embeddings": mc.max_position_embeddings,
        "checkpoint_dtype": str(mc.hf.get("torch_dtype") or mc.hf.get("dtype") or "bfloat16"),
    }


def config_info(c: ValidateConfig, data: EvalData, buckets: int) -> dict[str, Any]:
    return {
        "schemes": list(c.schemes),
        "as_configured": c.as_configured,
        "settings": c.settings.to_json() if c.as_configured else None,
        "quantization_config": c.quantization_config,
        "quantization": c.quantization,
        "precision": c.precision.value,
        "tensor_parallel_size": c.tensor_parallel_size,
        "context_len": data.context_len,
        "windows": len(data.window_starts),
        "buckets": buckets,
        "prompts": c.shape.prompts,
        "prompt_len": c.shape.prompt_len,
        "max_tokens": c.shape.max_tokens,
        "num_speculative_tokens": c.num_speculative_tokens,
        "ngram": c.shape.ngram,
        "threads": torch.get_num_threads(),
    }


def per_token_values(d: PositionDivergence) -> dict[str, list[float]]:
    """The per-position values llama.cpp's statistics need, at the T - 1 positions whose next token is
    known: KL, Δp = p_cand - p_ref of the next token, top-1 agreement, ΔNLL."""
    n = d.nll_delta.shape[0]
    p_ref = torch.exp(-d.nll_ref)
    p_cand = torch.exp(-(d.nll_ref + d.nll_delta))
    return {
        "kl": d.kl[:n].tolist(),
        "delta_p": (p_cand - p_ref).tolist(),
        "top1": d.top1[:n].tolist(),
        "nll_delta": d.nll_delta.tolist(),
    }


def totals(per_window: list[BucketSums]) -> dict[str, Totals]:
    """One ``Totals`` per quantity from one ``BucketSums`` per window (a quantity a window lacks: 0)."""
    names = dict.fromkeys(n for s in per_window for n in s.sums)
    out = {}
    for name in names:
        sums, counts = [], []
        for s in per_window:
            zero = [0.0] * s.buckets.count
            sums.append(s.sums[name].tolist() if name in s.sums else zero)
            counts.append(s.counts[name].tolist() if name in s.counts else zero)
        out[name] = Totals(sums, counts)
    return out


def variant_fields(
    v: Variant, descriptions: dict[str, str], per_window: list[BucketSums], layers: dict[int, bool]
) -> dict[str, Any]:
    """The fields every source fills alike in a VariantRecord: names, dtype, schemes, position totals, layers."""
    return {
        "name": v.name,
        "kind": v.kind.value,
        "dtype": dtype_name(v.dtype),
        "schemes": dict(descriptions),
        "positions": totals(per_window),
        "layers": [LayerRef(i, mtp) for i, mtp in sorted(layers.items())],
    }

"""Models: MLA attention, DeepSeek-V3-family decoder layers, MoE, MTP, checkpoint loading.

Public API::

    from mlaq.model import load_model, ModelCache
    model = load_model("path/to/checkpoint")        # policy decisions applied: model.bmm_decisions
    cache = ModelCache()
    out = model.prefill(ids, cache)                # (B, T) ids -> out.logits (B, T, V), out.hidden
    out = model.decode(next_ids, cache)            # absorbed MLA over the latent cache, T >= 1
    draft = model.mtp_step(next_ids, out.hidden, cache)  # MTP logits for the token after next
    out = model.decode(ids, cache, positions=pos)  # per-row positions (B, T): rows of different lengths
"""

from mlaq.model.config import IndexerConfig, ModelConfig, MoEConfig
from mlaq.model.layers.cache import LayerCache, ModelCache
from mlaq.model.layers.deepseek import CausalLMOutput, DeepseekForCausalLM
from mlaq.model.layers.mla import AttnPath
from mlaq.model.layers.mla_core import Precision
from mlaq.model.loading.loader import load_model
from mlaq.model.registry import supported_model_types

__all__ = [
    "AttnPath",
    "CausalLMOutput",
    "DeepseekForCausalLM",
    "IndexerConfig",
    "LayerCache",
    "MoEConfig",
    "ModelCache",
    "ModelConfig",
    "Precision",
    "load_model",
    "supported_model_types",
]

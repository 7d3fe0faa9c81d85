"""Re-quantization policy: which BMM scheme each MLA layer's kv_b_proj gets, and why.

Public API::

    from mlaq.settings import Settings
    from mlaq.policy import decide_from_dir
    result = decide_from_dir("path/to/checkpoint", Settings.from_env(), '{"targets": {...}}')
    result.for_layer(3).scheme        # "bf16", "fp8_per_block", "mxfp4", ...
    result.to_json()                  # what `mlaq explain --json` prints

Layering: this package imports ``mlaq.bmm`` (scheme names) and ``mlaq.settings`` only.
"""

from mlaq.policy.checkpoint import CheckpointQuant, KvBStorage
from mlaq.policy.decide import decide, decide_from_dir
from mlaq.policy.detect import checkpoint_quant
from mlaq.policy.explicit import ExplicitConfig, load_explicit, parse_explicit
from mlaq.policy.model_config import MlaModel, mla_model, read_checkpoint_dir
from mlaq.policy.patterns import Pattern
from mlaq.policy.result import LOGGER_NAME, LayerDecision, PolicyResult, Rule
from mlaq.policy.stored import StoredFormat

__all__ = [
    "LOGGER_NAME",
    "CheckpointQuant",
    "ExplicitConfig",
    "KvBStorage",
    "LayerDecision",
    "MlaModel",
    "Pattern",
    "PolicyResult",
    "Rule",
    "StoredFormat",
    "checkpoint_quant",
    "decide",
    "decide_from_dir",
    "load_explicit",
    "mla_model",
    "parse_explicit",
    "read_checkpoint_dir",
]

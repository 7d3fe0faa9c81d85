"""What ``mlaq validate`` runs: the settings of one validation, the variants it compares, the default eval text.

A *variant* is one way of running the same checkpoint: a compute dtype plus the BMM scheme every MLA
layer's absorbed matmuls use (``scheme=None``: the policy's per-layer decisions, ``--as-configured``).
Every candidate is compared with the REFERENCE (bf16 compute, bf16 BMMs: what every engine runs by
default) on the same weights, inputs and seeds; the NOISE_FLOOR (fp32 compute, fp32 BMMs) is measured the
same way, so a reader can tell which differences matter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import torch

from mlaq.bmm.registry import scheme_names
from mlaq.bundled import EVAL_TEXT_NAME
from mlaq.bundled import bundled_model_dir as bundled_model_dir  # re-exported (older callers import it here)
from mlaq.model import Precision
from mlaq.model.loading.online import check_online_precision
from mlaq.settings import Settings
from mlaq.validate import defaults as d
from mlaq.validate.defaults import DEFAULT_SCHEMES
from mlaq.validate.shape import RunShape


class VariantKind(Enum):
    REFERENCE = "reference"
    NOISE_FLOOR = "noise_floor"
    SCHEME = "scheme"
    AS_CONFIGURED = "as_configured"


@dataclass(frozen=True)
class Variant:
    """One way of running the checkpoint."""

    name: str  # report key: the scheme name, "fp32" (noise floor) or "as-configured"
    kind: VariantKind
    dtype: torch.dtype  # compute dtype of the whole model
    scheme: str | None  # BMM scheme of every MLA layer (MTP included); None: the policy's decisions


REFERENCE = Variant("bf16", VariantKind.REFERENCE, torch.bfloat16, "bf16")
NOISE_FLOOR = Variant("fp32", VariantKind.NOISE_FLOOR, torch.float32, "fp32")
AS_CONFIGURED = "as-configured"


def default_eval_text(model: Path) -> Path:
    """The held-out text shipped beside ``model``; a clear error when there is none."""
    path = model / EVAL_TEXT_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{model} has no {EVAL_TEXT_NAME}: pass --eval-text PATH (a text file the model was not trained on)"
        )
    return path


def check_schemes(names: tuple[str, ...]) -> tuple[str, ...]:
    """Known, distinct scheme names; an unknown one is an error listing the known ones."""
    known = scheme_names()
    for name in names:
        if name not in known:
            raise ValueError(f"unknown scheme {name!r}; known schemes: {', '.join(known)}")
    if len(set(names)) != len(names):
        raise ValueError(f"schemes listed twice: {', '.join(names)}")
    return names


@dataclass(frozen=True)
class ValidateConfig:
    """One validation of a local checkpoint (the engine, or ``--stream``): the run's shape, and what
    only a local run has (the checkpoint, the schemes, the engine's precision, MTP drafts, flip rows)."""

    model: Path
    shape: RunShape  # text, windows, prompts, tasks: what every source measures alike
    schemes: tuple[str, ...] = DEFAULT_SCHEMES
    as_configured: bool = False
    settings: Settings = field(default_factory=Settings)  # only for as_configured
    quantization_config: str | None = None  # only for as_configured (JSON text or @file)
    quantization: str | None = None  # "online": the config's targets mean vLLM's (the kv_b_proj linear)
    precision: Precision = Precision.DECODE_ONLY  # what prefill (naive MLA) computes with
    tensor_parallel_size: int = 1  # BMM scales computed per rank's shard of the heads (vLLM's TP)
    num_speculative_tokens: int = d.NUM_SPECULATIVE_TOKENS  # k; 0: plain greedy, no acceptance figures
    flip_rows: int = d.FLIP_ROWS  # query rows per window and layer for the attention flip rate; 0: none

    def __post_init__(self) -> None:
        check_schemes(self.schemes)
        if not self.schemes and not self.as_configured:
            raise ValueError("nothing to validate: give at least one scheme or --as-configured")
        if self.shape.eval_text is None:
            raise ValueError(f"no evaluation text for {self.model}: pass --eval-text PATH")
        if self.quantization is not None and self.quantization_config is None:
            raise ValueError("--quantization online applies a --quantization-config (as in vLLM); add one")
        if self.quantization is not None:  # before loading: the loader checks it again per model
            check_online_precision(self.precision)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be at least 1, got {self.tensor_parallel_size}")
        if self.flip_rows < 0:
            raise ValueError(f"flip_rows must be >= 0, got {self.flip_rows}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.quantization_config is not None and not self.as_configured:
            raise ValueError("--quantization-config is what --as-configured measures; pass both")

    def policy_config(self):  # -> ExplicitConfig | str | None
        """The config as the policy reads it (vLLM's meaning under ``--quantization online``)."""
        from mlaq.policy.explicit import policy_config

        return policy_config(self.quantization_config, self.quantization)

    @property
    def eval_text(self) -> Path:
        """The evaluation text (a local run always has one: the checkpoint's held-out file by default)."""
        assert self.shape.eval_text is not None
        return self.shape.eval_text

    def resolve_context(self, max_position_embeddings: int) -> int:
        """The teacher-forcing window length for a model with this context."""
        context_len = self.shape.context_len
        if context_len is None:
            return min(max_position_embeddings, d.MAX_DEFAULT_CONTEXT)
        if context_len > max_position_embeddings:
            raise ValueError(
                f"--context-len {context_len} exceeds the model's max_position_embeddings "
                f"{max_position_embeddings}; use at most {max_position_embeddings}"
            )
        return context_len

    def variants(self, reference: Variant = REFERENCE) -> tuple[Variant, ...]:
        """The candidates, in report order: schemes (at the reference's dtype), then as-configured."""
        out = [Variant(s, VariantKind.SCHEME, reference.dtype, s) for s in self.schemes]
        if self.as_configured:
            out.append(Variant(AS_CONFIGURED, VariantKind.AS_CONFIGURED, reference.dtype, None))
        return tuple(out)

"""Models for the variants: one loaded model per compute dtype, re-prepared per BMM scheme.

Every variant runs the SAME checkpoint weights (loaded once per dtype); switching schemes only
re-prepares the absorbed BMM weights of every MLA layer, the MTP layer(s) included
(``MLAttention.prepare``: split kv_b_proj, quantize W_UK and W_UV^T once). ``--as-configured`` loads the
checkpoint as a user's run would (settings + quantization config through the policy) and keeps the
loader's per-layer decisions.
"""

from __future__ import annotations

from typing import Any

import torch

from mlaq.bmm import get_scheme
from mlaq.bmm.tp import shard_heads
from mlaq.model import DeepseekForCausalLM, Precision, load_model
from mlaq.settings import Settings
from mlaq.validate.config import ValidateConfig, Variant, VariantKind


class ModelPool:
    """Loads lazily, keeps one model per dtype, remembers which scheme each currently holds."""

    def __init__(self, config: ValidateConfig) -> None:
        self.config = config
        self._models: dict[torch.dtype, DeepseekForCausalLM] = {}
        self._prepared: dict[torch.dtype, str] = {}
        # (dtype, scheme) -> every layer's prepared BMM weights: switching back installs them again
        # instead of re-quantizing (the task suite switches schemes once per batch)
        self._weights: dict[tuple[torch.dtype, str], list[Any]] = {}  # AbsorbedWeights per layer
        self._as_configured: DeepseekForCausalLM | None = None

    def _base(self, dtype: torch.dtype) -> DeepseekForCausalLM:
        if dtype not in self._models:
            # Settings() (every flag off), no explicit config: the checkpoint's weights as stored, then
            # every layer is re-prepared with the variant's scheme from the exactly dequantized kv_b_proj.
            self._models[dtype] = load_model(
                self.config.model,
                dtype=dtype,
                settings=Settings(),
                precision=self.config.precision,
                tensor_parallel_size=self.config.tensor_parallel_size,
            )
        return self._models[dtype]

    def model(self, variant: Variant) -> DeepseekForCausalLM:
        """The model of ``variant``, its BMMs prepared accordingly."""
        if variant.kind is VariantKind.AS_CONFIGURED:
            if self._as_configured is None:
                self._as_configured = load_model(
                    self.config.model,
                    dtype=variant.dtype,
                    settings=self.config.settings,
                    quantization_config=self.config.policy_config(),
                    precision=self.config.precision,
                    tensor_parallel_size=self.config.tensor_parallel_size,
                )
            return self._as_configured
        assert variant.scheme is not None
        model = self._base(variant.dtype)
        if self._prepared.get(variant.dtype) != variant.scheme:
            saved = self._weights.get((variant.dtype, variant.scheme))
            for i, layer in enumerate(model.model.layers):  # main and MTP layers alike
                ab = None if saved is None else saved[i]
                if ab is None:
                    scheme = shard_heads(get_scheme(variant.scheme), self.config.tensor_parallel_size)
                    layer.self_attn.prepare(scheme, self.config.precision)
                else:
                    attn = layer.self_attn
                    attn.set_absorbed(
                        ab.w_uk, ab.w_uv, ab.scheme_uk, scheme_uv=ab.scheme_uv, precision=ab.precision
                    )
            if saved is None:
                self._weights[(variant.dtype, variant.scheme)] = [
                    x.self_attn.absorbed for x in model.model.layers
                ]
            self._prepared[variant.dtype] = variant.scheme
        return model

    def decisions(self) -> list[dict[str, Any]]:
        """The as-configured model's per-layer policy decisions (``mlaq explain --json`` rows)."""
        if self._as_configured is None:
            return []
        return [d.to_json() for d in self._as_configured.bmm_decisions]


def scheme_descriptions(model: DeepseekForCausalLM) -> dict[str, str]:
    """Scheme name -> its exact arithmetic, for every scheme a model's layers use."""
    out: dict[str, str] = {}
    for layer in model.model.layers:
        ab = layer.self_attn.absorbed
        if ab is not None:
            out[ab.scheme_uk.name] = ab.scheme_uk.description
            out[ab.scheme_uv.name] = ab.scheme_uv.description
    return out


def precision_of(name: str) -> Precision:
    """``decode_only`` / ``consistent`` / ``absorbed`` -> Precision, with a clear error."""
    try:
        return Precision(name)
    except ValueError:
        raise ValueError(
            f"--precision {name!r}: expected one of {', '.join(p.value for p in Precision)}"
        ) from None

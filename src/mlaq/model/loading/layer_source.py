"""One layer at a time from a checkpoint: the weights of a decoder layer, of one routed expert, of the
embedding rows a batch uses and of the head, each read when asked for and owned by the caller.

This is what a layer-streaming run needs to execute a model larger than memory: nothing is kept
between calls, tensors are read by byte range (range_checkpoint.py: no memory map grows the resident set),
in the checkpoint's stored precision, and dequantized exactly by the loader's own readers (weights.py)
before being cast to each compute dtype asked for. A decoder layer comes back with its routed experts
left on the meta device (no memory): ``expert`` reads one of them, so an MoE layer never holds more
than one routed expert. Module and tensor names are the loader's, so a streamed layer holds exactly
the values ``load_model`` would have put in the same layer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from mlaq.model.config import ModelConfig
from mlaq.model.layers.decoder import DecoderLayer
from mlaq.model.layers.mla_config import MLAConfig
from mlaq.model.layers.moe import DenseMLP
from mlaq.model.layers.mtp import MTPLayer
from mlaq.model.layers.norm import RMSNorm
from mlaq.model.loading.checkpoint import check_finite
from mlaq.model.loading.loader import _FP32_PARAMS, _mtp_layers_present
from mlaq.model.loading.range_checkpoint import RangeCheckpoint
from mlaq.model.loading.weights import (
    CheckpointQuant,
    CheckpointWeight,
    WeightFormat,
    read_linear,
    read_tensor,
)
from mlaq.model.registry import MlpKind

LOGGER = logging.getLogger("mlaq.model")
EXPERTS = "mlp.experts."
SLAB_ELEMENTS = (
    2**24
)  # FP8-block dequantization works this many elements (64 MiB of fp32) at a time  # routed experts' module prefix inside a layer (read one by one)
_MTP_SKIP = ("embed_tokens", "shared_head.head")  # vocabulary-sized: rows / the head are read apart


@dataclass
class StreamedLayer:
    """Layer ``index`` in each compute dtype asked for (routed experts on meta) and its stored kv_b_proj."""

    index: int
    modules: dict[torch.dtype, DecoderLayer]
    kv_b: CheckpointWeight


class LayerSource:
    """A checkpoint directory read layer by layer. ``bytes_read`` counts checkpoint bytes read so far."""

    def __init__(self, path: str | Path, *, load_mtp: bool | None = None) -> None:
        self.path = Path(path)
        self.config = ModelConfig.from_dir(self.path)
        self.mla_config = MLAConfig.from_hf(self.config.hf)
        self.quant = CheckpointQuant.from_hf(self.config.hf, str(self.path / "config.json"))
        if self.quant.method is None and (self.path / "hf_quant_config.json").is_file():
            raise ValueError(
                f"{self.path / 'hf_quant_config.json'}: ModelOpt checkpoints (e.g. NVFP4) cannot be loaded"
            )
        self.reader = RangeCheckpoint(self.path)
        self.num_mtp_layers = _mtp_layers_present(self.config, self.reader, load_mtp)  # type: ignore[arg-type]

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read

    @property
    def num_layers(self) -> int:
        """Main layers then MTP layers, in checkpoint order."""
        return self.config.num_hidden_layers + self.num_mtp_layers

    def is_moe(self, layer: int) -> bool:
        return self.config.mlp_kind(layer) is MlpKind.SPARSE

    # ---- sizes, for planning -----------------------------------------------------------------------
    def stored_bytes(self, names: Iterable[str]) -> int:
        return sum(self.reader.nbytes(n) for n in names if self.reader.has(n))

    def layer_names(self, layer: int, *, experts: bool) -> list[str]:
        """Tensor names of layer ``layer`` (with or without its routed experts; never the MTP layer's
        vocabulary-sized tensors)."""
        prefix = f"model.layers.{layer}."
        out = []
        for name in self.reader.keys():  # noqa: SIM118 (not a mapping)
            if not name.startswith(prefix):
                continue
            local = name[len(prefix) :]
            if local.startswith(_MTP_SKIP) or (not experts and local.startswith(EXPERTS)):
                continue
            out.append(name)
        return out

    def expert_names(self, layer: int, expert: int) -> list[str]:
        prefix = f"model.layers.{layer}.{EXPERTS}{expert}."
        return [n for n in self.reader.keys() if n.startswith(prefix)]  # noqa: SIM118

    def head_name(self) -> str:
        if self.reader.has("lm_head.weight") or not self.config.tie_word_embeddings:
            return "lm_head.weight"
        return "model.embed_tokens.weight"

    # ---- reading -----------------------------------------------------------------------------------
    def layer(self, index: int, dtypes: Sequence[torch.dtype]) -> StreamedLayer:
        """Decoder layer ``index`` (an MTP layer past num_hidden_layers) in every dtype of ``dtypes``."""
        cfg, kw = self.config, {"device": "meta"}
        modules: dict[torch.dtype, DecoderLayer] = {}
        for dt in dtypes:
            if index >= cfg.num_hidden_layers:
                modules[dt] = MTPLayer(
                    cfg, self.mla_config, index, own_embed=False, own_head=False, dtype=dt, **kw
                )
            else:
                modules[dt] = DecoderLayer(cfg, self.mla_config, index, dtype=dt, **kw)
        stored = self._fill(modules, f"model.layers.{index}.", skip=(EXPERTS.rstrip("."), *_MTP_SKIP))
        kv_b = stored.get("self_attn.kv_b_proj")
        assert kv_b is not None
        return StreamedLayer(index, modules, kv_b)

    def expert(self, layer: int, expert: int, dtypes: Sequence[torch.dtype]) -> dict[torch.dtype, DenseMLP]:
        """Routed expert ``expert`` of MoE layer ``layer`` in every dtype of ``dtypes``."""
        moe = self.config.moe
        assert moe is not None
        h = self.config.hidden_size
        modules = {dt: DenseMLP(h, moe.moe_intermediate_size, dtype=dt, device="meta") for dt in dtypes}
        self._fill(modules, f"model.layers.{layer}.{EXPERTS}{expert}.")
        return modules

    def embedding_rows(self, name: str, token_ids: Tensor) -> tuple[Tensor, Tensor]:
        """The rows of embedding ``name`` that ``token_ids`` use, as stored, and ``token_ids`` remapped
        to index them: ``rows[remapped]`` equals ``embedding[token_ids]``."""
        unique, remapped = torch.unique(token_ids, return_inverse=True)
        rows = self.reader.get_rows(name, unique.tolist())
        check_finite(rows, self.reader.where(name))
        return rows, remapped

    def norm(self, dtypes: Sequence[torch.dtype]) -> dict[torch.dtype, RMSNorm]:
        h, eps = self.config.hidden_size, self.config.rms_norm_eps
        modules = {dt: RMSNorm(h, eps, dtype=dt, device="meta") for dt in dtypes}
        self._fill(modules, "model.norm.")
        return modules

    def head(self, dtypes: Sequence[torch.dtype]) -> dict[torch.dtype, Tensor]:
        """The lm_head weight (vocab, hidden) in each dtype (the embedding when tied)."""
        cfg = self.config
        name = self.head_name()
        if name == "lm_head.weight":
            stored = read_linear(self.reader, self.quant, "lm_head", (cfg.vocab_size, cfg.hidden_size))  # type: ignore[arg-type]
            return {
                dt: w.contiguous()
                for dt, w in _dequantized(stored, list(dtypes), self.reader.where(name)).items()
            }
        weight = read_tensor(self.reader, name, (cfg.vocab_size, cfg.hidden_size))  # type: ignore[arg-type]
        return {dt: weight.to(dt).contiguous() for dt in dtypes}

    def _fill(
        self, modules: dict[torch.dtype, nn.Module], prefix: str, skip: tuple[str, ...] = ()
    ) -> dict[str, CheckpointWeight]:
        """Read every parameter of the (meta) modules under ``prefix`` once and set it in each dtype, as
        the loader does (linear weights exactly dequantized, fp32 routing bias). Returns the stored
        linear weights by local module name."""
        template = next(iter(modules.values()))
        stored_by_name: dict[str, CheckpointWeight] = {}
        reader = self.reader
        for local, module in template.named_modules():
            if local and local.startswith(skip):
                continue
            full = prefix + local if local else prefix.rstrip(".")
            if isinstance(module, nn.Linear):
                stored = read_linear(reader, self.quant, full, tuple(module.weight.shape))  # type: ignore[arg-type]
                for dt, weight in _dequantized(stored, list(modules), reader.where(f"{full}.weight")).items():
                    _set(modules[dt].get_submodule(local), "weight", weight)
                if local.endswith("kv_b_proj"):  # the policy step needs it as stored
                    stored_by_name[local] = stored
                del stored
                if module.bias is not None:
                    bias = read_tensor(reader, f"{full}.bias", tuple(module.bias.shape))  # type: ignore[arg-type]
                    for dt, mod in modules.items():
                        _set(mod.get_submodule(local), "bias", bias.to(dt))
                continue
            for pname, param in list(module.named_parameters(recurse=False)):
                tensor = read_tensor(reader, f"{full}.{pname}", tuple(param.shape))  # type: ignore[arg-type]
                for dt, mod in modules.items():
                    value = tensor.float() if pname in _FP32_PARAMS else tensor.to(dt)
                    _set(mod.get_submodule(local), pname, value)
        return stored_by_name


def _dequantized(
    stored: CheckpointWeight, dtypes: list[torch.dtype], where: str
) -> dict[torch.dtype, Tensor]:
    """The weight's exact value in each dtype. Dense weights are cast straight from their stored dtype
    (exact, as via fp32, without an fp32 copy); FP8 blocks are dequantized a slab of block rows at a
    time (elementwise code x scale: the same values as the whole tensor at once, with a transient of
    one slab instead of a whole fp32 copy); other formats whole."""
    if stored.format is WeightFormat.DENSE:
        check_finite(stored.codes, where)
        return {dt: stored.codes.to(dt) for dt in dtypes}
    if stored.format is not WeightFormat.FP8_BLOCK or stored.block is None or stored.scale is None:
        weight = stored.dequantize()
        check_finite(weight, where)
        return {dt: weight.to(dt) for dt in dtypes}
    rows, k = stored.codes.shape
    b0 = stored.block[0]
    step = b0 * max(1, SLAB_ELEMENTS // (b0 * k))  # whole block rows per slab
    out = {dt: torch.empty(rows, k, dtype=dt) for dt in dtypes}
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        scale = stored.scale[r0 // b0 : -(-r1 // b0)]
        part = _fp8_block_slab(stored.codes[r0:r1], scale, stored.block)
        check_finite(part, where)
        for dt in dtypes:
            out[dt][r0:r1] = part
    return out


def _fp8_block_slab(codes: Tensor, scale: Tensor, block: tuple[int, int]) -> Tensor:
    """codes (r, k) e4m3 x their blocks' scales (ceil(r/b0), ceil(k/b1)) in fp32. The fp32 product of a
    4-bit-significand code and an fp32 scale is rounded once, as Fp8Tensor.dequantize's exact float64
    product rounded to fp32 is (its docstring): the same values, without float64 temporaries."""
    b0, b1 = block
    r, k = codes.shape
    cols = scale.float().repeat_interleave(b1, dim=1)[:, :k]  # (ceil(r/b0), k)
    out = codes.float()  # e4m3 -> fp32 is exact
    if r % b0 == 0:
        out.view(r // b0, b0, k).mul_(cols[:, None, :])
    else:
        out.mul_(cols.repeat_interleave(b0, dim=0)[:r])
    return out


def _set(module: nn.Module, pname: str, tensor: Tensor) -> None:
    module._parameters[pname] = nn.Parameter(tensor.contiguous(), requires_grad=False)

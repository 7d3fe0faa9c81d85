"""``compile=True``: the per-token work of decode, verification and MTP steps through ``torch.compile``.

Eager decode is bound by per-op dispatch (hundreds of small tensor ops a step at a few microseconds
each on these model sizes). A step is cut at each layer's attention over the cache
(:class:`mlaq.model.layers.step_pieces.StepPieces`): the pieces in between (norms, projections, RoPE,
the absorbed BMMs, o_proj, MLP / MoE, lm_head) run compiled, inductor fusing them into a few C++
kernels around the GEMMs; the attention itself runs eagerly between them: each layer writes its new
latents into the runner's resident buffer (``mlaq.engine.resident``, held in the compute dtype here)
and attends over it in place, the cache read once with an online softmax as FlashMLA computes, in
mlaq's own C kernel (``mlaq.model.kernels.mla_kernel``, ``attention="mlaq"``; about twice torch's speed at
batch 32) or torch's fused CPU attention kernel (``mlaq.model.layers.mla_flash``, ``attention="torch"``).
The absorbed BMMs keep their scheme's exact emulation, whatever the scheme: the ``bf16`` scheme's in
mlaq's kernel beside the attention (``MlaKernel.absorb`` / ``.up``: the bf16 weights, a quarter of the
bytes of the float64 copy inductor would read), inside the pieces for the other schemes inductor reproduces
bit for bit (``BmmScheme.compiles_exactly``: fp32, the FP8 and MXFP4 schemes), eagerly beside the
attention for the rest. vLLM's piecewise graphs cut its steps at
attention the same way. Prompts (prefill) stay eager: they run once per request and their lengths
vary; with mlaq's kernel, their causal attention runs in it too up to 1,024 keys
(``MLAttention.prefill_kernel``).

The pieces never see the cache length, so a growing cache never recompiles; batch size and T (the
tokens per row) are specialized at first and made dynamic by dynamo when they change (a handful of
graphs per piece and run). Inductor freezes the parameters (weights become constants of the graph,
linear weights prepacked) and emits a C++ launcher; both settings apply only while these pieces run
(torch's global config is left as it was). Frozen graphs belong to one model: each piece of each
``CompiledLatentLM`` is a compile region of its own (``isolate_recompiles``), so another ``LLM`` in the
same process compiles its own (tested), and the process's compile cache keeps the weights of earlier
ones alive. Within a region dynamo checks only a call's inputs, not the hundreds of attributes down
the model (``compile_regions.inputs_only``): the model is taken as it was when the pieces were built (frozen weights
are constants anyway), and a model whose BMM weights are prepared again is refused.

Compilation happens on first use of each piece and shape (seconds each on a few cores). Tokens
chosen greedily are those of the eager path on the tested checkpoints, but logits differ in the last
bits: the fused pieces round some intermediates differently, and the attention kernels normalize the
softmax at the end (torch's also rounds the probabilities to the compute dtype first); eager decode
and ``mlaq validate`` keep the reference arithmetic.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from mlaq.bmm.base import DenseWeight
from mlaq.engine.adapter import DeepseekLatentLM, GatheredCache
from mlaq.engine.compile_regions import Settings, compiled_region
from mlaq.engine.model_api import LMOutput
from mlaq.model import DeepseekForCausalLM
from mlaq.model.kernels.mla_kernel import BMM_COLS, KernelUnavailable, MlaKernel, load_kernel
from mlaq.model.layers.mla_flash import flash_attend, flash_output, flash_queries
from mlaq.model.layers.step import StepPositions
from mlaq.model.layers.step_pieces import Projected, StepPieces

ATTENTION_CHOICES = ("auto", "mlaq", "torch")
LOGGER = logging.getLogger("mlaq.engine")


class CompiledLatentLM(DeepseekLatentLM):
    """``DeepseekLatentLM`` whose absorbed-path calls run their per-token pieces compiled."""

    def __init__(
        self,
        model: DeepseekForCausalLM,
        *,
        backend: str = "inductor",
        fold_bmms: bool = True,
        attention: str = "auto",
        max_autotune: bool = False,
        kernel_bmms: bool = True,
        fuse_linears: bool = True,
    ) -> None:
        """``backend``: torch.compile's (tests use "aot_eager": the same graphs, no C++ build).
        ``fold_bmms=False``: the absorbed BMMs run eagerly beside the attention whatever the scheme
        (``bench/compiled_ab.py --against unfolded``). ``attention``: the kernel over the cache,
        "mlaq" (``mlaq.model.kernels.mla_kernel``; an error where it cannot be built), "torch" (torch's fused
        kernel) or "auto" (mlaq's where it builds, else torch's, with a warning saying why).
        ``fuse_linears=False``: no stacked q_a / kv_a and gate / up GEMMs (``StepPieces``; A/B)."""
        super().__init__(model)
        self.kernel = _attention_kernel(attention)  # None: torch's kernel
        for layer in model.model.layers:  # prompts (eager, naive path) attend in the same kernel
            layer.self_attn.prefill_kernel = self.kernel
        self.room_dtype = model.dtype  # the flash kernel reads the latents in the compute dtype
        self._attns = [layer.self_attn for layer in model.model.layers]
        self._kernel_bmms = _kernel_bmm_weights(model, self.kernel) if kernel_bmms and fold_bmms else {}
        outside = frozenset(self._kernel_bmms)
        pieces = self._pieces = StepPieces(
            model, fold_bmms=fold_bmms, outside=outside, fuse_linears=fuse_linears
        )
        # in force while a step's pieces run (and may compile)
        self._settings = Settings(backend, max_autotune=max_autotune)
        n = model.config.num_hidden_layers
        self._head = compiled_region(pieces.head, backend)
        self._between = [compiled_region(_at(pieces.between, i), backend) for i in range(n - 1)]
        self._tail = compiled_region(_at(pieces.tail, n - 1), backend)
        self._mtp_head = compiled_region(pieces.mtp_head, backend) if model.num_mtp_layers else None
        self._mtp_tail = compiled_region(pieces.mtp_tail, backend) if model.num_mtp_layers else None
        self._prepared = self._absorbed_weights()  # what the pieces were built for (see _unchanged)

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        past: Sequence[Tensor],
        *,
        prefill: bool,
        logits_index: Tensor | None = None,
        room: Tensor | None = None,
    ) -> LMOutput:
        if prefill or len(past) == 0 or past[0].shape[1] == 0:
            return super().forward(
                input_ids, positions, past, prefill=prefill, logits_index=logits_index, room=room
            )
        self._unchanged()
        cache = GatheredCache(past, self._latent_width, first_layer=0, room=room)
        step = self.model.step_positions(input_ids, cache, 0, positions)
        with self._settings:
            p = self._head(input_ids, step.positions, step.cos, step.sin)
            for i, piece in enumerate(self._between):
                p = piece(p[0], self._attend(i, cache, step, p), step.positions, step.cos, step.sin)
            logits, hidden = self._tail(p[0], self._attend(len(self._between), cache, step, p), logits_index)
        return LMOutput(logits, hidden, tuple(cache.entries))

    @torch.no_grad()
    def mtp(
        self,
        input_ids: Tensor,
        hidden: Tensor,
        positions: Tensor,
        past: Tensor,
        *,
        step: int,
        logits_index: Tensor | None = None,
    ) -> LMOutput:
        m = self.model
        # the compiled pieces are MTP layer 0's; nothing cached yet: the eager path (once per request)
        if self._mtp_head is None or self._mtp_tail is None or step % m.num_mtp_layers or past.shape[1] == 0:
            return super().mtp(input_ids, hidden, positions, past, step=step, logits_index=logits_index)
        self._unchanged()
        index = m.config.num_hidden_layers
        cache = GatheredCache([past], self._latent_width, first_layer=index)
        where = m.step_positions(input_ids, cache, index, positions)
        with self._settings:
            projected = self._mtp_head(input_ids, hidden, where.positions, where.cos, where.sin)
            logits, y = self._mtp_tail(
                projected[0], self._attend(index, cache, where, projected), logits_index
            )
        return LMOutput(logits, y, tuple(cache.entries))

    def _absorbed_weights(self) -> tuple[object, ...]:
        return tuple(layer.self_attn.absorbed for layer in self.model.model.layers)

    def _unchanged(self) -> None:
        """The pieces are guarded on their inputs only (``compile_regions.inputs_only``): refuse a model whose BMM
        weights were prepared again (another scheme) after they were built."""
        if any(now is not then for now, then in zip(self._absorbed_weights(), self._prepared, strict=True)):
            raise ValueError(
                "compile=True: the model's absorbed BMM weights were prepared again after its compiled "
                "pieces were built; build a new LLM (or CompiledLatentLM) for the new scheme"
            )

    def _attend(self, i: int, cache: GatheredCache, step: StepPositions, projected: Projected) -> Tensor:
        """Layer i's attention over the cache, eagerly: write the new latents (as ``DecoderLayer``), then
        attend over every key in mlaq's kernel or torch's -> ``StepPieces.between``'s o: the kernel's
        output where the pieces run the layer's BMMs, else the absorbed path's (B, T, N, V) (BMMs in
        mlaq's kernel for the ``bf16`` scheme, else eagerly in the scheme's torch emulation)."""
        _, q, latent = projected
        attn = self._attns[i]  # (ModuleList indexing costs ~8 us a call)
        keys, _ = cache.update(i, step, latent, None)  # (B, K, L+R)
        w = attn._checked_absorbed()  # kv_b_proj unchanged since prepare (the pieces cannot check)
        c = attn.config
        bmm_weights = self._kernel_bmms.get(i)
        if bmm_weights is not None and self.kernel is not None:  # BMM #1, attention, BMM #2 in mlaq's kernel
            folded = self.kernel.absorb(q, bmm_weights[0])
            o = self._over_cache(folded, keys, step.mask, c.num_heads, attn.softmax_scale, c.kv_lora_rank)
            return self.kernel.up(o, bmm_weights[1], q.shape[1])
        if self._pieces.folds(i):
            return self._over_cache(q, keys, step.mask, c.num_heads, attn.softmax_scale, c.kv_lora_rank)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        folded = flash_queries(q_nope, q_pe, w)  # BMM #1, eagerly
        o = self._over_cache(folded, keys, step.mask, c.num_heads, attn.softmax_scale, c.kv_lora_rank)
        return flash_output(o, w, c.num_heads, q.dtype)  # BMM #2

    def _over_cache(
        self, q: Tensor, keys: Tensor, mask: Tensor | None, n: int, scale: float, lora: int
    ) -> Tensor:
        """Folded queries (B, 1, N*T, L+R) over the keys (B, K, L+R) -> (B, 1, N*T, L or L+R), in the
        chosen kernel (``flash_output`` keeps the first L columns)."""
        if self.kernel is not None and self.kernel.supports(q, keys, lora):
            return self.kernel.attend(q, keys, mask, n, scale, lora)
        return flash_attend(q, keys, mask, n, scale)


def _kernel_bmm_weights(
    model: DeepseekForCausalLM, kernel: MlaKernel | None
) -> dict[int, tuple[Tensor, Tensor]]:
    """Layer index -> its prepared W_UK and W_UV^T (bf16), for the layers whose two BMMs mlaq's kernel
    computes exactly: both the ``bf16`` scheme, bf16 model, widths multiples of BMM_COLS."""
    if kernel is None or model.dtype != torch.bfloat16:
        return {}
    weights = {}
    for i, layer in enumerate(model.model.layers):
        w = layer.self_attn.absorbed
        if w is None or not (w.scheme_uk.name == w.scheme_uv.name == "bf16"):
            continue
        uk, uv = w.w_uk, w.w_uv
        if not (isinstance(uk, DenseWeight) and isinstance(uv, DenseWeight)):
            continue
        if uk.weight.dtype != torch.bfloat16 or uk.shape[2] % BMM_COLS or uv.shape[2] % BMM_COLS:
            continue
        weights[i] = (uk.weight.contiguous(), uv.weight.contiguous())
    return weights


def _attention_kernel(attention: str) -> MlaKernel | None:
    """``CompiledLatentLM``'s ``attention`` choice -> mlaq's loaded kernel, or None for torch's."""
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"attention={attention!r}: choose one of {', '.join(ATTENTION_CHOICES)}")
    if attention == "torch":
        return None
    try:
        return load_kernel()
    except KernelUnavailable as e:
        if attention == "mlaq":
            raise
        LOGGER.warning("compile=True attends with torch's kernel: mlaq's could not be built: %s", e)
        return None


def _at(piece: Callable[..., Any], i: int) -> Callable[..., Any]:
    """``piece`` with its layer index bound: each layer's piece is its own function (own frozen graph)."""

    def bound(*args: Any) -> Any:
        return piece(i, *args)

    return bound

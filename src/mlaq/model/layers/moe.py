"""The MLPs: the dense SwiGLU MLP, and the mixture of experts (router ``mlp.gate``, routed and shared
experts, each a SwiGLU MLP).

Routing follows DeepSeek's gates (V2 §2.1.2, V3 §2.1.2), in fp32 as every reference computes it:
  scores   = softmax(logits) (V2) or sigmoid(logits) (V3 and later)
  choice   = scores + e_score_correction_bias (noaux_tc only: the bias steers selection, not weights)
  groups   = keep the ``topk_group`` best of ``n_group`` expert groups, a group scored by its best
             expert (group_limited_greedy) or the sum of its top two (noaux_tc); other groups masked
  experts  = top ``num_experts_per_tok`` of ``choice``; weights = ``scores`` at those experts,
             renormalized to sum 1 when ``norm_topk_prob``, then times ``routed_scaling_factor``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mlaq.model.config import MoEConfig
from mlaq.model.layers.linear import Linear, fuse_rows, linear, upcast_gemm
from mlaq.model.registry import ScoringFunc, TopkMethod

# Up to this many tokens, routed experts run token by token (k small matmuls each, no gather/scatter
# bookkeeping): cheaper for decode and MTP verification; larger batches group tokens by expert.
SMALL_BATCH = 4
# From 2 up to this many tokens, a layer whose experts were stacked (``MoE.stack_experts``, done by the
# loader) and that has at most STACKED_FANOUT x k experts runs every routed expert for every token
# through three stacked GEMMs: fewer, larger calls than one per chosen expert (bench/moe_stacked.py:
# 0.35-0.69x the time from 4 to 32 tokens on an AMD EPYC Zen 4, the same outputs bit for bit).
STACKED_MAX = 32
STACKED_FANOUT = 4


class DenseMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)); Hugging Face parameter names."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        kw = {"bias": False, "dtype": dtype, "device": device}
        self.gate_proj = Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: Tensor, gate_up: Tensor | None = None) -> Tensor:
        """``gate_up``: gate_proj's and up_proj's weights stacked (``linear.fuse_rows``; vLLM's
        ``gate_up_proj``): both in one GEMM (``compile=True``'s pieces)."""
        # F.linear on the weights: the same matmuls without three nn.Module calls (decode is
        # dominated by per-call overhead at these sizes)
        if gate_up is None:
            gate, up = linear(x, self.gate_proj.weight), linear(x, self.up_proj.weight)
        else:
            gate, up = linear(x, gate_up).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.down_proj.weight)


def route(logits: Tensor, cfg: MoEConfig, correction_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(T, E) fp32 router logits -> (weights (T, k) fp32, expert indices (T, k) int64)."""
    t, e = logits.shape
    scores = logits.softmax(dim=-1) if cfg.scoring_func is ScoringFunc.SOFTMAX else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    grouped = cfg.topk_method is not TopkMethod.GREEDY and cfg.n_group > 1
    if grouped:
        per_group = choice.view(t, cfg.n_group, e // cfg.n_group)  # (T, G, E/G)
        if cfg.topk_method is TopkMethod.NOAUX_TC:
            group_scores = per_group.topk(2, dim=-1).values.sum(dim=-1)  # (T, G)
        else:
            group_scores = per_group.max(dim=-1).values
        kept = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices  # (T, topk_group)
        dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, kept, False)  # (T, G)
        # V2 fills masked experts with 0 (scores are positive softmax values); V3 with -inf.
        fill = float("-inf") if cfg.topk_method is TopkMethod.NOAUX_TC else 0.0
        choice = per_group.masked_fill(dropped[:, :, None], fill).view(
            t, e
        )  # every expert of a dropped group
    indices = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False).indices  # (T, k)
    # noaux_tc weighs by the unbiased scores; V2 by the (group-masked) scores it chose from.
    weights = (scores if cfg.topk_method is TopkMethod.NOAUX_TC else choice).gather(1, indices)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, indices


class Router(nn.Module):
    """``mlp.gate``: weight (E, hidden) and, for noaux_tc, ``e_score_correction_bias`` (E,) fp32."""

    def __init__(
        self, hidden_size: int, cfg: MoEConfig, *, dtype: torch.dtype, device: torch.device | str | None
    ) -> None:
        super().__init__()
        self.cfg = cfg
        weight = torch.empty(cfg.n_routed_experts, hidden_size, dtype=dtype, device=device)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.e_score_correction_bias: nn.Parameter | None = None
        if cfg.topk_method is TopkMethod.NOAUX_TC:
            # kept in fp32 whatever the compute dtype (transformers: _keep_in_fp32_modules_strict)
            bias = torch.empty(cfg.n_routed_experts, dtype=torch.float32, device=device)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(T, hidden) -> (weights (T, k) fp32, indices (T, k))."""
        logits = F.linear(x.float(), self.weight.float())  # (T, E); routing is always fp32
        bias = None if self.e_score_correction_bias is None else self.e_score_correction_bias.float()
        return route(logits, self.cfg, bias)


class MoE(nn.Module):
    """Routed experts plus ``n_shared_experts`` always-on experts fused into one MLP."""

    def __init__(
        self,
        hidden_size: int,
        cfg: MoEConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        kw = {"dtype": dtype, "device": device}
        self.gate = Router(hidden_size, cfg, **kw)
        self.experts = nn.ModuleList(
            DenseMLP(hidden_size, cfg.moe_intermediate_size, **kw) for _ in range(cfg.n_routed_experts)
        )
        self._expert_list = tuple(self.experts)  # plain indexing (ModuleList's is slow per token)
        self.shared_experts = (
            DenseMLP(hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, **kw)
            if cfg.n_shared_experts > 0
            else None
        )
        self._stacked: tuple[Tensor, Tensor, Tensor] | None = None  # see stack_experts

    def stack_experts(self) -> None:
        """Store the routed experts' weights in three stacked tensors, (E*I, H) gate, (E*I, H) up and
        (E, H, I) down, and make each expert's parameters views of them (no second copy; state_dict
        and in-place loads see the same memory). A parameter replaced later (``.to()``, a new tensor)
        is no longer a view: the stacked path then stands aside (``_live_stack``)."""
        experts = self._expert_list
        gate = fuse_rows(*(e.gate_proj for e in experts))
        up = fuse_rows(*(e.up_proj for e in experts))
        assert gate is not None and up is not None  # experts are built alike: no bias, one dtype and width
        down = torch.stack([e.down_proj.weight.data for e in experts])
        for i, e in enumerate(experts):
            e.down_proj.weight.data = down[i]
        self._stacked = (gate, up, down)

    def _live_stack(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """The stacked weights if every expert parameter is still the view ``stack_experts`` made."""
        s = self._stacked
        if s is None:
            return None
        gate, up, down = s
        inter = down.shape[2]
        step = inter * gate.shape[1] * gate.element_size()
        for i, e in enumerate(self._expert_list):
            if (
                e.gate_proj.weight.data_ptr() != gate.data_ptr() + i * step
                or e.up_proj.weight.data_ptr() != up.data_ptr() + i * step
                or e.down_proj.weight.data_ptr() != down[i].data_ptr()
                or e.gate_proj.weight.dtype != gate.dtype
            ):
                return None
        return s

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (T, hidden)
        weights, indices = self.gate(flat)
        n, k = indices.shape
        stacked = None
        if 2 <= n <= STACKED_MAX and len(self._expert_list) <= STACKED_FANOUT * k:
            stacked = self._live_stack()
        if stacked is not None:
            out = self._all_experts(flat, weights, indices, stacked)
        elif flat.shape[0] <= SMALL_BATCH:
            rows = [self._one_token(flat, weights, chosen, t) for t, chosen in enumerate(indices.tolist())]
            out = rows[0] if len(rows) == 1 else torch.cat(rows)
        else:
            out = self._grouped(flat, weights, indices)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)

    def _grouped(self, flat: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
        """Tokens grouped by expert: each chosen expert runs once over its tokens (ascending token
        order), experts visited in ascending order; each token's k contributions are summed."""
        k = indices.shape[1]
        choices = indices.reshape(-1)  # (T*k,) row-major: token-major, then slot
        order = torch.argsort(choices, stable=True)  # (T*k,) by expert, tokens ascending within one
        counts = torch.bincount(choices, minlength=len(self._expert_list)).tolist()
        tokens = order // k  # (T*k,)
        x = flat[tokens]  # (T*k, hidden)
        w = weights.reshape(-1)[order, None]  # (T*k, 1)
        out = torch.zeros_like(flat)
        start = 0
        for expert, n in enumerate(counts):
            if n:
                y = self._expert_list[expert](x[start : start + n])  # (n, hidden)
                out.index_add_(0, tokens[start : start + n], (y * w[start : start + n]).to(out.dtype))
                start += n
        return out

    def _all_experts(
        self, flat: Tensor, weights: Tensor, indices: Tensor, stacked: tuple[Tensor, Tensor, Tensor]
    ) -> Tensor:
        """Every routed expert over every token through the stacked weights; each token's chosen experts
        summed in ascending expert order, each contribution rounded as ``_grouped`` rounds it (an expert a
        token did not choose adds an exact zero)."""
        gate, up, down = stacked
        e, _, inter = down.shape
        t = flat.shape[0]
        a = (F.silu(linear(flat, gate)) * linear(flat, up)).view(t, e, inter).transpose(0, 1)  # (E, T, I)
        if upcast_gemm(a, down):  # linear's policy: float32 where the CPU has no fast bf16 GEMM
            y = torch.bmm(a.float(), down.float().transpose(1, 2)).to(flat.dtype)
        else:
            y = torch.bmm(a, down.transpose(1, 2))  # (E, T, H)
        dense = torch.zeros(t, e, dtype=weights.dtype, device=flat.device).scatter_(1, indices, weights)
        out = torch.zeros_like(flat)
        for j in sorted(set(indices.reshape(-1).tolist())):  # the experts some token chose, ascending
            out = out + (y[j] * dense[:, j, None]).to(flat.dtype)
        return out

    def _one_token(self, flat: Tensor, weights: Tensor, experts: list[int], t: int) -> Tensor:
        """Token t alone (decode, verification): its k chosen experts run directly and are summed in
        ascending expert order (the order, and so the rounding, of the batched path) -> (1, hidden)."""
        x, w = flat[t : t + 1], weights[t : t + 1]  # (1, hidden), (1, k)
        chosen = sorted(zip(experts, range(len(experts)), strict=True))
        out = None
        for expert, slot in chosen:
            y = (self._expert_list[expert](x) * w[:, slot, None]).to(flat.dtype)  # (1, hidden)
            out = y if out is None else out + y
        assert out is not None
        return out

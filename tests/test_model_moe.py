"""The MoE router against a second, per-token formulation written from DeepSeek's papers, and the MoE
block against an explicit sum over the chosen experts."""

from __future__ import annotations

import math

import pytest
import torch

from mlaq.model.config import MoEConfig
from mlaq.model.layers.moe import MoE, route
from mlaq.model.registry import ScoringFunc, TopkMethod


def _cfg(scoring, method, n_group=1, topk_group=1, norm=True, k=3, experts=16) -> MoEConfig:
    return MoEConfig(
        n_routed_experts=experts,
        num_experts_per_tok=k,
        moe_intermediate_size=8,
        n_shared_experts=1,
        n_group=n_group,
        topk_group=topk_group,
        scoring_func=scoring,
        topk_method=method,
        norm_topk_prob=norm,
        routed_scaling_factor=2.5,
    )


def _reference(logits: list[float], cfg: MoEConfig, bias: list[float] | None) -> dict[int, float]:
    """{expert: weight} for one token, with plain Python arithmetic."""
    e = len(logits)
    if cfg.scoring_func is ScoringFunc.SOFTMAX:
        m = max(logits)
        ex = [math.exp(v - m) for v in logits]
        scores = [v / sum(ex) for v in ex]
    else:
        scores = [1 / (1 + math.exp(-v)) for v in logits]
    choice = [s + (bias[i] if bias else 0.0) for i, s in enumerate(scores)]
    allowed = set(range(e))
    if cfg.topk_method is not TopkMethod.GREEDY and cfg.n_group > 1:
        size = e // cfg.n_group
        groups = [choice[g * size : (g + 1) * size] for g in range(cfg.n_group)]
        if cfg.topk_method is TopkMethod.NOAUX_TC:
            rank = [sum(sorted(g, reverse=True)[:2]) for g in groups]  # top-2 sum (V3)
        else:
            rank = [max(g) for g in groups]  # best expert (V2)
        kept = sorted(range(cfg.n_group), key=lambda g: -rank[g])[: cfg.topk_group]
        allowed = {g * size + j for g in kept for j in range(size)}
    chosen = sorted(allowed, key=lambda i: -choice[i])[: cfg.num_experts_per_tok]
    weights = {i: scores[i] for i in chosen}
    if cfg.norm_topk_prob:
        total = sum(weights.values())
        weights = {i: w / total for i, w in weights.items()}
    return {i: w * cfg.routed_scaling_factor for i, w in weights.items()}


@pytest.mark.parametrize(
    "cfg",
    [
        _cfg(ScoringFunc.SOFTMAX, TopkMethod.GREEDY, norm=False),
        _cfg(ScoringFunc.SOFTMAX, TopkMethod.GROUP_LIMITED_GREEDY, 4, 2, norm=False),
        _cfg(ScoringFunc.SIGMOID, TopkMethod.NOAUX_TC, 4, 2),
        _cfg(ScoringFunc.SIGMOID, TopkMethod.NOAUX_TC, 8, 3, k=4),
        _cfg(ScoringFunc.SIGMOID, TopkMethod.NOAUX_TC, 1, 1, norm=False),
    ],
    ids=["v2-greedy", "v2-group-limited", "v3-noaux", "v3-noaux-8groups", "glm-ungrouped"],
)
def test_router_matches_per_token_reference(cfg):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, cfg.n_routed_experts, generator=gen)
    bias = (
        torch.randn(cfg.n_routed_experts, generator=gen) * 0.3
        if cfg.topk_method is TopkMethod.NOAUX_TC
        else None
    )
    weights, indices = route(logits, cfg, bias)
    for t in range(logits.shape[0]):
        ref = _reference(logits[t].tolist(), cfg, None if bias is None else bias.tolist())
        got = dict(zip(indices[t].tolist(), weights[t].tolist(), strict=True))
        assert sorted(got) == sorted(ref), f"token {t}: experts {sorted(got)} vs {sorted(ref)}"
        for i, w in ref.items():
            assert got[i] == pytest.approx(w, rel=1e-5)


def test_correction_bias_steers_choice_not_weights():
    cfg = _cfg(ScoringFunc.SIGMOID, TopkMethod.NOAUX_TC, k=1, norm=False)
    logits = torch.zeros(1, 16)
    logits[0, 3] = 1.0  # the best score ...
    bias = torch.zeros(16)
    bias[7] = 10.0  # ... loses to a biased expert, whose weight is still its unbiased score
    weights, indices = route(logits, cfg, bias)
    assert indices.tolist() == [[7]]
    assert weights.item() == pytest.approx(0.5 * 2.5)


def test_moe_block_is_the_weighted_sum_of_chosen_experts():
    cfg = _cfg(ScoringFunc.SIGMOID, TopkMethod.NOAUX_TC, 4, 2)
    torch.manual_seed(1)
    moe = MoE(12, cfg)
    for p in moe.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(2, 5, 12)
    out = moe(x)
    flat = x.reshape(-1, 12)
    weights, indices = moe.gate(flat)

    def mlp(m, v):
        return (
            torch.nn.functional.silu(v @ m.gate_proj.weight.T) * (v @ m.up_proj.weight.T)
        ) @ m.down_proj.weight.T

    for t in range(flat.shape[0]):
        want = mlp(moe.shared_experts, flat[t])
        for w, e in zip(weights[t], indices[t], strict=True):
            want = want + w * mlp(moe.experts[int(e)], flat[t])
        assert torch.allclose(out.reshape(-1, 12)[t], want, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 3])
def test_small_batch_path_equals_the_grouped_path(tokens, monkeypatch):
    """Decode-sized batches run experts token by token; the result equals grouping tokens by expert
    (bit for bit for one token: same matmuls, same summation order)."""
    import mlaq.model.layers.moe as moe_module

    cfg = _cfg(ScoringFunc.SIGMOID, TopkMethod.NOAUX_TC, 4, 2)
    torch.manual_seed(2)
    moe = MoE(12, cfg)
    for p in moe.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(1, tokens, 12)
    small = moe(x)
    monkeypatch.setattr(moe_module, "SMALL_BATCH", 0)
    grouped = moe(x)
    if tokens == 1:
        assert torch.equal(small, grouped)
    assert torch.allclose(small, grouped, rtol=1e-6, atol=1e-6)


def _stackable_moe(dtype: torch.dtype) -> MoE:
    cfg = _cfg(ScoringFunc.SIGMOID, TopkMethod.NOAUX_TC, 4, 2, k=2, experts=8)  # 8 experts <= 4 x top-2
    torch.manual_seed(4)
    moe = MoE(16, cfg)
    for p in moe.parameters():
        p.data.normal_(0, 0.3)
    return moe.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [2, 4, 9, 32, 33])
def test_stacked_experts_give_the_per_expert_results(dtype, tokens):
    """Decode-sized batches on stacked weights: every expert for every token, each token's chosen ones
    summed in the per-expert paths' order -> the same outputs (the same dot products through fewer,
    larger GEMM calls: bit for bit on this machine's GEMMs, within one rounding step anywhere)."""
    moe = _stackable_moe(dtype)
    x = torch.randn(tokens, 16).to(dtype)
    with torch.no_grad():
        want = moe(x)
        moe.stack_experts()
        assert moe._live_stack() is not None
        got = moe(x)
    tol = 1e-6 if dtype == torch.float32 else 2**-7  # float32: reassociation; bf16: one rounding step
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * float(want.float().abs().max()))
    if dtype == torch.bfloat16:  # rounded to bf16, another fp32 summation order rarely shows
        assert (got != want).float().mean() <= 0.01


def test_stacked_experts_are_views_and_stand_aside_when_replaced(monkeypatch):
    """No second copy of the experts: their parameters are views of the stacked tensors (state_dict
    included). A parameter replaced afterwards is not, and the stacked path is not taken."""
    import mlaq.model.layers.moe as moe_module

    moe = _stackable_moe(torch.float32)
    x = torch.randn(6, 16)
    with torch.no_grad():
        want = moe(x)
    moe.stack_experts()
    gate, _, down = moe._stacked
    assert moe.state_dict()["experts.0.gate_proj.weight"].data_ptr() == gate.data_ptr()
    assert moe.experts[7].down_proj.weight.data_ptr() == down[7].data_ptr()
    calls = []
    real = moe_module.MoE._all_experts
    monkeypatch.setattr(moe_module.MoE, "_all_experts", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        moe(x)
        assert calls == [1]
        moe.experts[3].up_proj.weight.data = moe.experts[3].up_proj.weight.data.clone()  # no longer a view
        assert moe._live_stack() is None
        again = moe(x)
    assert calls == [1] and torch.allclose(again, want, rtol=1e-6, atol=1e-6)

"""The DSA lightning indexer: scores by an explicit per-(query, key, head) sum, and the top-k selection.
(The whole path, shared layers included, is checked against transformers in test_model_parity.)"""

from __future__ import annotations

import math

import torch

from mlaq.model.config import IndexerConfig
from mlaq.model.layers.dsa import Indexer
from mlaq.model.layers.rope import Rope
from mlaq.model.registry import IndexerKind


def _indexer(topk: int = 3, interleave: bool = True) -> Indexer:
    cfg = IndexerConfig(
        n_heads=4, head_dim=12, topk=topk, rope_interleave=interleave, kinds=(IndexerKind.FULL,)
    )
    torch.manual_seed(0)
    idx = Indexer(hidden_size=10, q_lora_rank=6, cfg=cfg, mla_rope=Rope(8, 10000.0))
    for p in idx.parameters():
        p.data.normal_(0, 0.5)
    return idx


@torch.no_grad()
def test_scores_are_weighted_relu_dot_products():
    idx = _indexer()
    b, t = 2, 5
    hidden, q_latent = torch.randn(b, t, 10), torch.randn(b, t, 6)
    positions = torch.arange(t).expand(b, t)
    keys = idx.keys(hidden, positions)  # (B, T, D), first 8 channels rotated
    scores = idx.scores(hidden, q_latent, positions, keys)
    q = idx._rotate((q_latent @ idx.wq_b.weight.T).view(b, t, 4, 12), positions)
    w = hidden @ idx.weights_proj.weight.T
    for bi in range(b):
        for i in range(t):
            for j in range(t):
                want = sum(
                    float(w[bi, i, h]) / 2.0 * max(float(q[bi, i, h] @ keys[bi, j]) / math.sqrt(12), 0.0)
                    for h in range(4)
                )
                assert math.isclose(float(scores[bi, i, j]), want, rel_tol=1e-5, abs_tol=1e-6)


@torch.no_grad()
def test_keys_are_layernormed_and_roped_on_the_first_rope_dims_only():
    idx = _indexer()
    hidden = torch.randn(1, 3, 10)
    k0 = idx.keys(hidden, torch.zeros(1, 3, dtype=torch.long))  # position 0: no rotation
    ln = torch.nn.functional.layer_norm(
        hidden @ idx.wk.weight.T, (12,), idx.k_norm.weight, idx.k_norm.bias, 1e-6
    )
    assert torch.allclose(k0, ln, atol=1e-6)
    k5 = idx.keys(hidden, torch.full((1, 3), 5))
    assert torch.equal(k5[..., 8:], k0[..., 8:])  # the non-rotary channels are untouched
    assert not torch.allclose(k5[..., :8], k0[..., :8])


def test_select_keeps_topk_visible_keys():
    idx = _indexer(topk=3)
    t = 6
    scores = torch.randn(1, t, t)
    visible = torch.ones(t, t, dtype=torch.bool).tril()[None]  # causal
    keep = idx.select(scores, visible)
    assert not (keep & ~visible).any()
    for i in range(t):
        n_visible = i + 1
        assert int(keep[0, i].sum()) == min(3, n_visible)
        if n_visible > 3:
            best = scores[0, i, : i + 1].topk(3).indices.sort().values
            assert torch.equal(keep[0, i].nonzero().flatten(), best)

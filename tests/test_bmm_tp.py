"""--tensor-parallel-size: each rank's BMM scales are computed over its own shard of the heads.

Oracle: vLLM's AITER re-quantizer ``dynamic_per_batched_tensor_quant`` (mla_attention.py) written out
here independently — bf16 amax over the RANK's tensor, bf16 ``448 / amax``, codes of the scaled bf16
values — applied to each rank's contiguous heads (ColumnParallelLinear's split of kv_b_proj's rows).
"""

from __future__ import annotations

import pytest
import torch

from mlaq.bmm import get_scheme
from mlaq.bmm.kv_b import split_kv_b_proj
from mlaq.bmm.tp import ShardedWeight, TensorParallel, check_tp_size, head_shards, shard_heads
from mlaq.bundled import bundled_model_dir as bundled_model
from mlaq.model import load_model


def _aiter_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM 0.32 dynamic_per_batched_tensor_quant on a bf16 tensor: (e4m3fn codes, fp32 dequant scale)."""
    x = w.to(torch.bfloat16)
    lo, hi = x.aminmax()
    amax = torch.maximum(lo.abs(), hi.abs()).clamp(min=1e-10)
    scale = 448.0 / amax  # bf16 0-dim
    codes = (x * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return codes, scale.float().reciprocal()


def _weight(heads: int = 4) -> torch.Tensor:
    """(H, K, M) with heads of very different magnitude: a shard's amax differs from the whole's."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(heads, 16, 8, generator=g)
    return (w * torch.logspace(0, 3, heads).view(heads, 1, 1)).to(torch.bfloat16).float()


@pytest.mark.parametrize("tp", [2, 4])
def test_per_tensor_scale_is_per_shard(tp: int) -> None:
    w = _weight()
    prepared = shard_heads(get_scheme("fp8_per_tensor"), tp).prepare(w)
    assert isinstance(prepared, ShardedWeight) and len(prepared.shards) == tp
    whole = get_scheme("fp8_per_tensor").prepare(w)
    for (a, b), shard in zip(head_shards(4, tp), prepared.shards, strict=True):
        codes, scale = _aiter_per_tensor(w[a:b])
        assert torch.equal(shard.codes.view(torch.uint8), codes.view(torch.uint8))
        assert shard.scale.reshape(()).item() == scale.item()
    # rank 0 holds the small heads: its scale is not the whole tensor's (the last rank's is)
    assert prepared.shards[0].scale.reshape(()).item() != whole.scale.reshape(()).item()


def test_apply_runs_each_rank_on_its_heads() -> None:
    w, x = _weight(), torch.randn(4, 3, 16, generator=torch.Generator().manual_seed(1))
    inner = get_scheme("fp8_per_tensor")
    tp = TensorParallel(inner, 2)
    y = tp.apply(x, tp.prepare(w))
    want = torch.cat([inner.apply(x[a:b], inner.prepare(w[a:b])) for a, b in head_shards(4, 2)])
    assert torch.equal(y, want)
    assert not torch.equal(y, inner.apply(x, inner.prepare(w)))  # the global scale gives other bits
    assert torch.equal(tp.prepare(w).dequantize(), torch.cat([s.dequantize() for s in tp.prepare(w).shards]))


def test_head_local_schemes_are_unchanged() -> None:
    """Scales inside a head (MX blocks along K, per head): every bit equal at any size."""
    w, x = _weight(), torch.randn(4, 3, 16, generator=torch.Generator().manual_seed(2))
    for name in ("mxfp4", "fp8_per_head", "mxfp8"):
        s = get_scheme(name)
        assert torch.equal(shard_heads(s, 4)(x, w), s(x, w)), name
    assert (
        shard_heads(get_scheme("bf16"), 2) is not None and shard_heads(get_scheme("bf16"), 2).name == "bf16"
    )


def test_size_must_divide_heads_as_vllm_says() -> None:
    with pytest.raises(
        ValueError,
        match=r"^Total number of attention heads \(4\) must be divisible by tensor parallel size \(3\)\.$",
    ):
        check_tp_size(3, 4)
    with pytest.raises(ValueError, match="at least 1"):
        check_tp_size(0, 4)


def test_loader_quantizes_each_ranks_rows() -> None:
    """load_model(tensor_parallel_size=2): layer l's W_UK / W_UV^T shard r is the AITER quantization of
    rank r's rows of kv_b_proj (heads [2r, 2r+2)), for every layer (the MTP layer's too)."""
    path = bundled_model()
    cfg = '{"targets": {"re:.*kv_b_proj": "fp8_per_tensor"}}'
    model = load_model(path, quantization_config=cfg, tensor_parallel_size=2)
    ref = load_model(path)  # bf16: kv_b_proj's weight as stored
    assert model.tensor_parallel_size == 2
    for layer, base in zip(model.model.layers, ref.model.layers, strict=True):
        c = base.self_attn.config
        ab = layer.self_attn.absorbed
        rows = base.self_attn.kv_b_proj.weight.detach().float()
        per = rows.shape[0] // 2
        for r in range(2):
            uk, uv_t = split_kv_b_proj(
                rows[r * per : (r + 1) * per], c.num_heads // 2, c.qk_nope_head_dim, c.v_head_dim
            )
            for got, want in ((ab.w_uk.shards[r], uk), (ab.w_uv.shards[r], uv_t)):
                codes, scale = _aiter_per_tensor(want)
                assert torch.equal(got.codes.view(torch.uint8), codes.view(torch.uint8))
                assert got.scale.reshape(()).item() == scale.item()


def test_loader_refuses_a_size_not_dividing_the_heads() -> None:
    with pytest.raises(
        ValueError, match=r"attention heads \(4\) must be divisible by tensor parallel size \(3\)"
    ):
        load_model(bundled_model(), tensor_parallel_size=3)

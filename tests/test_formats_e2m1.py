"""E2M1 elements (exhaustive over bf16 against ml_dtypes) and nibble packing."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlaq.formats import e2m1_decode, e2m1_encode, e2m1_round, pack_e2m1, unpack_e2m1


def test_decode_all_16_codes_like_ml_dtypes():
    codes = torch.arange(16, dtype=torch.uint8)
    ref = codes.numpy().view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(e2m1_decode(codes).numpy(), ref)
    assert e2m1_decode(codes)[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_all_bf16_inputs_encode_like_ml_dtypes():
    """All 65,536 bf16 inputs: our RNE+saturate codes == ml_dtypes.float4_e2m1fn after clamping to ±6."""
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    xn = x.numpy()
    keep = ~np.isnan(xn)  # E2M1 has no NaN; NaN blocks are handled by the E8M0 scale
    ours = e2m1_encode(x).numpy()[keep]
    ref = np.clip(xn[keep], -6.0, 6.0).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    np.testing.assert_array_equal(ours, ref)
    # the arithmetic fast path, compared as fp32 bit patterns (so -0 vs +0 counts)
    ref_vals = ref.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(e2m1_round(x).numpy()[keep].view(np.uint32), ref_vals.view(np.uint32))
    np.testing.assert_array_equal(
        e2m1_round(x.bfloat16()).numpy()[keep].view(np.uint32), ref_vals.view(np.uint32)
    )
    assert torch.isnan(e2m1_round(x[torch.from_numpy(~keep)])).all()


def test_ties_and_saturation_by_hand():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, float("inf"), -0.25, -5.0, -1e9, -0.0])
    assert e2m1_round(x).tolist() == [0, 1, 1, 2, 2, 4, 4, 6, 6, -0.0, -4, -6, -0.0]
    assert e2m1_encode(torch.tensor([-0.0, -0.1])).tolist() == [8, 8]  # the sign of a zero is kept


def test_packing_low_nibble_first_golden_bytes():
    codes = torch.tensor([[1, 2, 15, 0, 7, 8]], dtype=torch.uint8)
    assert pack_e2m1(codes).tolist() == [[0x21, 0x0F, 0x87]]
    assert pack_e2m1(codes.T, axis=0).T.tolist() == [[0x21, 0x0F, 0x87]]
    assert unpack_e2m1(torch.tensor([0x21, 0x0F, 0x87], dtype=torch.uint8)).tolist() == [1, 2, 15, 0, 7, 8]


def test_unpack_accepts_torch_fp4x2_storage():
    packed = torch.tensor([0x21, 0x87], dtype=torch.uint8)
    assert unpack_e2m1(packed.view(torch.float4_e2m1fn_x2)).tolist() == [1, 2, 7, 8]


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 7), min_size=1, max_size=3),
    axis_pick=st.integers(0, 2),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_unpack_round_trip(shape, axis_pick, seed):
    axis = axis_pick % len(shape)
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, shape, generator=g, dtype=torch.int32).to(torch.uint8)
    packed = pack_e2m1(codes, axis)
    assert packed.shape[axis] == (shape[axis] + 1) // 2
    assert torch.equal(unpack_e2m1(packed, axis, size=shape[axis]), codes)
    if shape[axis] % 2 == 0:
        assert torch.equal(unpack_e2m1(packed, axis), codes)
        # and pack(unpack(bytes)) is the identity on arbitrary bytes
        raw = torch.randint(0, 256, packed.shape, generator=g, dtype=torch.int32).to(torch.uint8)
        assert torch.equal(pack_e2m1(unpack_e2m1(raw, axis), axis), raw)


def test_packing_rejects_bad_input():
    with pytest.raises(ValueError, match="uint8"):
        pack_e2m1(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"0\.\.15"):
        pack_e2m1(torch.tensor([3, 16], dtype=torch.uint8))
    with pytest.raises(ValueError, match="size 5"):
        unpack_e2m1(torch.zeros(4, dtype=torch.uint8), size=5)

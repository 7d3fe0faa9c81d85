"""SGLang 0.5.23's FP8 schemes, bit for bit: against SGLang's own Python functions (run from an unpacked
sglang 0.5.23 wheel: ``pip download --no-deps sglang==0.5.23 -d ~/.cache/sglang-src`` and unzip it there,
or point SGLANG_SRC at the directory holding ``sglang/``; skipped with that message where absent), and
against an independent numpy re-derivation that always runs."""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from mlaq.bmm import get_scheme
from mlaq.bmm.sglang_fp8 import sglang_input_to_float8, sglang_kv_b_proj, sglang_mla_act_quant
from mlaq.formats import Fp8Dtype

FN, FNUZ = Fp8Dtype.E4M3FN, Fp8Dtype.E4M3FNUZ
NP_FP8 = {FN: ml_dtypes.float8_e4m3fn, FNUZ: ml_dtypes.float8_e4m3fnuz}
SGLANG_MAX = {FN: 448.0, FNUZ: 224.0}


def _sglang_root() -> Path | None:
    for root in (os.environ.get("SGLANG_SRC"), Path.home() / ".cache" / "sglang-src"):
        if root and (Path(root) / "sglang" / "srt" / "layers" / "quantization" / "fp8_utils.py").is_file():
            return Path(root)
    return None


def sglang_function(relpath: str, name: str, namespace: dict[str, Any]):
    """SGLang's own function ``name`` from ``sglang/<relpath>``, compiled alone (its module imports
    Triton and CUDA kernels that do not load here) with ``namespace`` as its module globals."""
    root = _sglang_root()
    if root is None:
        pytest.skip(
            "SGLang 0.5.23 source absent: pip download --no-deps sglang==0.5.23 -d ~/.cache/sglang-src and "
            "unzip the wheel there (or set SGLANG_SRC)"
        )
    tree = ast.parse((root / "sglang" / relpath).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    glb = {"torch": torch, "Optional": Any, "Tuple": tuple, "List": list, **namespace}
    exec(compile(ast.Module([node], []), relpath, "exec"), glb)
    return glb[name]


def sglang_input_to_float8_reference(dtype: Fp8Dtype):
    fnuz = dtype is FNUZ
    return sglang_function(
        "srt/layers/quantization/fp8_utils.py",
        "input_to_float8",
        {"_is_fp8_fnuz": fnuz, "fp8_dtype": dtype.torch_dtype, "fp8_max": SGLANG_MAX[dtype]},
    )


def weights(seed: int, shape=(2 * (128 + 128), 512)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.exp(torch.randn(shape[0], 1, generator=g))
    return w.bfloat16()


@pytest.mark.parametrize("dtype", [FN, FNUZ])
def test_input_to_float8_matches_sglang(dtype):
    ref = sglang_input_to_float8_reference(dtype)
    for seed in range(4):
        w = weights(seed)
        codes, scale = sglang_input_to_float8(w, dtype)
        want_codes, want_scale = ref(w, dtype.torch_dtype)
        assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)), seed
        assert scale.dtype == torch.float32 and torch.equal(scale, want_scale), seed


def test_w8a16_dequant_matches_sglang():
    absorb = sglang_function(
        "srt/models/deepseek_common/attention_forward_methods/forward_mla_rocm.py", "_absorb_weight_bf16", {}
    )
    s = get_scheme("fp8_per_tensor_w8a16_sglang_fnuz")
    w = s.prepare(weights(5).float().view(4, 128, 512))
    codes, scale = sglang_input_to_float8(weights(5).view(4, 128, 512), FNUZ)
    assert torch.equal(s.dequantized_bf16(w), absorb(codes, scale))


def test_block_to_tensor_requant_matches_sglang():
    """A block-FP8 checkpoint off CUDA: block_quant_to_tensor_quant == input_to_float8 of the exact values."""
    ref8 = sglang_input_to_float8_reference(FN)
    b2t = sglang_function(
        "srt/layers/quantization/fp8_utils.py",
        "block_quant_to_tensor_quant",
        {"_is_cuda": False, "input_to_float8": ref8, "List": list},
    )
    g = torch.Generator().manual_seed(6)
    codes = (torch.randn(512, 512, generator=g) * 100).to(torch.float8_e4m3fn)
    scales = torch.rand(4, 4, generator=g) * 1e-3
    want_codes, want_scale = b2t(codes, scales, [128, 128])
    exact = codes.float() * scales.repeat_interleave(128, 0).repeat_interleave(128, 1)
    got_codes, got_scale = sglang_input_to_float8(exact, FN)
    assert torch.equal(got_codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(got_scale, want_scale)


# --- independent numpy re-derivation (always runs) ---


def np_input_to_float8(x: np.ndarray, dtype: Fp8Dtype) -> tuple[np.ndarray, np.float32]:
    fp_max = np.float32(SGLANG_MAX[dtype])
    x32 = x.astype(np.float32)
    amax = max(np.float32(np.abs(x32).max()), np.float32(1e-12))
    s = np.float32(np.float32(1) / amax) * fp_max  # reciprocal, then times fp_max: two fp32 roundings
    q = np.clip(x32 * s, -fp_max, fp_max).astype(NP_FP8[dtype])
    return q, np.float32(np.float32(1) / s)


@pytest.mark.parametrize("dtype", [FN, FNUZ])
def test_input_to_float8_matches_numpy(dtype):
    for seed in range(6):
        w = weights(seed)
        codes, scale = sglang_input_to_float8(w, dtype)
        q, s = np_input_to_float8(w.float().numpy(), dtype)
        assert np.array_equal(codes.view(torch.uint8).numpy(), q.view(np.uint8)), seed
        assert float(scale) == float(s)
    codes, scale = sglang_input_to_float8(torch.zeros(4, 4), dtype)  # amax floored at 1e-12, codes 0
    assert not codes.float().any() and float(scale) == float(np_input_to_float8(np.zeros((4, 4)), dtype)[1])


def test_batch_act_quant_and_scheme_match_numpy():
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(4, 9, 192, generator=g) * 3).bfloat16()
    s = get_scheme("fp8_per_tensor_batch_sglang")
    w = s.prepare(torch.randn(4, 192, 64, generator=g))
    xq, xs = sglang_mla_act_quant(x, FN)
    x32 = x.float().numpy()
    scale = np.float32(max(np.float32(np.abs(x32).max()), np.float32(1e-12)) / np.float32(448))
    q = np.clip(x32 * np.float32(np.float32(1) / scale), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    assert float(xs) == float(scale) and np.array_equal(xq.numpy(), q.astype(np.float32))
    acc = np.einsum("nbk,nkm->nbm", q.astype(np.float64), w.codes.float().numpy().astype(np.float64))
    want = (acc.astype(np.float32) * np.float32(scale * np.float32(w.scale.item()))).astype(
        ml_dtypes.bfloat16
    )
    assert np.array_equal(s.apply(x, w).numpy(), want.astype(np.float32))


def test_batch_scheme_depends_on_the_batch_and_others_do_not():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(4, 8, 192, generator=g).bfloat16()
    loud = x.clone()
    loud[:, 7] *= 50  # another token with a larger amax coarsens every token's activation codes
    for name in ("fp8_per_tensor_batch_sglang", "fp8_per_tensor_sglang", "fp8_per_tensor_w8a16_sglang"):
        s = get_scheme(name)
        w = s.prepare(torch.randn(4, 192, 64, generator=g))
        same = torch.equal(s.apply(x, w)[:, :7], s.apply(loud, w)[:, :7])
        assert same is s.batch_invariant, name


def test_kv_b_proj_halves_share_one_scale():
    """SGLang quantizes the whole kv_b_proj, then splits it: W_UK and W_UV^T carry the same scale."""
    n, p, v, lora = 2, 128, 128, 512
    w = weights(9, (n * (p + v), lora))
    w[0, 0] = 1000.0  # the amax lies in W_UK: W_UV's own amax would give a finer scale
    uk_s, uv_s = get_scheme("fp8_per_tensor_sglang_fnuz"), get_scheme("fp8_per_tensor_w8a16_sglang_fnuz")
    uk, uv = sglang_kv_b_proj(uk_s, uv_s, w.float(), n, p, v)
    codes, scale = sglang_input_to_float8(w, FNUZ)
    assert float(uk.scale) == float(uv.scale) == float(scale)
    assert uk.shape == (n, p, lora) and uv.shape == (n, lora, v)
    assert torch.equal(
        uv.codes.view(torch.uint8), codes.view(n, p + v, lora)[:, p:].transpose(1, 2).view(torch.uint8)
    )
    own = uv_s.prepare(uv.dequantize())
    assert float(own.scale) != float(uv.scale)
    with pytest.raises(ValueError, match="FP8 dtypes differ"):
        sglang_kv_b_proj(get_scheme("fp8_per_tensor_sglang"), uv_s, w.float(), n, p, v)

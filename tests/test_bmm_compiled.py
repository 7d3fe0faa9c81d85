"""``BmmScheme.compiles_exactly``: a scheme that says inductor reproduces it runs inside ``compile=True``'s
compiled pieces (mlaq.model.layers.step_pieces), so its compiled ``apply`` must equal the eager one bit for bit.

Every such scheme, both BMM shapes of DeepSeek-V3's geometry (W_UK (N, 128, 512), W_UV^T (N, 512, 128)),
one row (decode: inductor writes a one-row bmm as a multiply and a sum) and several (an extern bmm), with
activations that reach the FP8 / FP4 saturation and subnormal ranges and a row of zeros. All schemes in
one compiled function per row count: two C++ builds for the file (tens of seconds on 2 cores).
"""

from __future__ import annotations

import pytest
import torch

from mlaq.bmm import get_scheme
from mlaq.bmm.registry import scheme_names
from mlaq.engine.compile_regions import Settings

EXACT = [name for name in scheme_names() if get_scheme(name).compiles_exactly]
SHAPES = [(4, 128, 512), (4, 512, 128)]  # (N, K, M)


def test_the_reference_fp8_and_mxfp4_schemes_say_they_compile_exactly():
    assert {"bf16", "fp32", "fp8_per_tensor", "fp8_per_block", "mxfp4", "mxfp4_w4a16"} <= set(EXACT)
    # their emulations do not build under inductor (torch 2.13): they run eagerly beside the attention
    assert not {"bf16_sm90", "fp8_per_block_sm90", "mxfp8"} & set(EXACT)


def _activations(g: torch.Generator, n: int, rows: int, k: int) -> torch.Tensor:
    x = torch.randn(n, rows, k, generator=g) * 3
    x[:, :, : k // 8] *= 1e3  # saturates e4m3 / e2m1 under a per-tensor or per-block scale
    x[:, :, k // 8 : k // 4] *= 1e-30  # subnormal once scaled
    if rows > 1:
        x[:, 1] = 0  # an all-zero row: a zero amax (scale rules' edge case)
    return x.bfloat16().float()  # the engine hands the BMMs bf16 values held in float32


@pytest.mark.parametrize("rows", [1, 5])
def test_compiled_apply_equals_eager_bit_for_bit(rows):
    g = torch.Generator().manual_seed(rows)
    cases = []
    for name in EXACT:
        scheme = get_scheme(name)
        for n, k, m in SHAPES:
            weight = scheme.prepare(torch.randn(n, k, m, generator=g) * 0.05)
            cases.append((name, scheme, weight, _activations(g, n, rows, k)))

    def every_scheme(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [scheme.apply(x, w) for (_, scheme, w, _), x in zip(cases, xs, strict=True)]

    compiled = torch.compile(every_scheme, backend="inductor", dynamic=False)
    xs = [x for *_, x in cases]
    with Settings("inductor"), torch.no_grad():
        got = compiled(xs)
    for (name, scheme, w, x), out in zip(cases, got, strict=True):
        want = scheme.apply(x, w)
        same = torch.equal(out, want)
        assert same, f"{name} {tuple(w.shape)} rows={rows}: {(out != want).sum().item()} elements differ"

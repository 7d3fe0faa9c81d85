"""The audit's per-weight figures computed in place: bit for bit the values of :mod:`mlaq.audit.stats`.

``stats`` states every figure plainly (the spec: each step allocates, and a scheme's weight is built by
its ``prepare``, codes and a float64 copy included). A DeepSeek-V3 layer holds two 8.4 M-element
weights; on a CPU a fresh 32 MiB tensor costs ~20 ms of page faults and an in-place pass over a reused
one ~3 ms. So here every figure comes from the same torch operation on the same values as in ``stats``,
written into the buffers of a :class:`Workspace` that lives as long as an audit worker:

- each scheme's weight is computed once per tensor straight into fp32 (``prepare(w).dequantize(float32)``:
  an MX element or an FP8 code times its scale is exact there), without codes or float64 caches;
- MX: the scales come from the block amax the reference already took; the elements are |src| * 2^-u
  rounded by :func:`round_magnitudes_` (an fp32 add that rounds to the element grid), signs restored;
- the difference to the exact weight is formed in place, then normed and min/maxed as ``stats`` does.

torch's full reductions (norm, mean) depend on the intra-op thread count: ``audit`` runs its layers on
one thread each, so a report is the same on every machine. tests/test_audit_fast.py pins every figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mlaq.audit.stats import Reference, SchemeError, WeightStats, scheme_error, weight_stats
from mlaq.bmm import (
    BmmScheme,
    Fp8PerBlock,
    Fp8PerChannel,
    Fp8PerHead,
    Fp8PerTensor,
    Mxfp4,
    Mxfp4W4A16,
    Mxfp8,
    MxWeight,
    PreparedWeight,
)
from mlaq.bmm.fp8_quant import vllm_batched_tensor_quant
from mlaq.bmm.theory import theory_for
from mlaq.formats import MxElem, ScaleRule, quantize_fp8
from mlaq.formats.blocks import resolve_block
from mlaq.formats.scale_rules import E8M0_BIAS, E8M0_NAN, e8m0_decode, e8m0_scale_exponent
from mlaq.model.loading.weights import CheckpointWeight, WeightFormat

_AITER_FP8 = (Fp8PerTensor, Fp8PerHead, Fp8PerChannel)
_MX = (Mxfp4, Mxfp4W4A16, Mxfp8)
EMIN = {MxElem.E2M1: 0, MxElem.E4M3: -6, MxElem.E5M2: -14}  # exponent of the smallest normal element


@torch.no_grad()
def exact_into(stored: CheckpointWeight, ws: Workspace) -> Tensor:
    """``stored.dequantize()``, the weight's exact fp32 value, as ``ws``'s "full" buffer: the same values
    (an FP8 code times its fp32 scale, rounded once), without the float64 temporaries."""
    if stored.format is WeightFormat.DENSE:
        return ws.get("full", tuple(stored.codes.shape)).copy_(stored.codes)
    if stored.format not in (
        WeightFormat.FP8_BLOCK,
        WeightFormat.FP8_PER_TENSOR,
        WeightFormat.FP8_PER_CHANNEL,
    ):
        value = stored.dequantize()
        return ws.get("full", tuple(value.shape)).copy_(value)
    fp8 = stored.fp8()  # the loader's checks of the codes and scales
    out = ws.get("full", fp8.shape)
    (rows, cols), (br, bc) = fp8.shape, resolve_block(fp8.shape, fp8.block)
    fp8_into(out, fp8.codes, ws.get("tmp", (rows, cols)))
    if rows % br or cols % bc:  # ragged edge blocks
        return out.mul_(fp8.expanded_scale())
    # one scale per (br, bc) block: (R, L) -> (R/br, br, L/bc, bc) times (R/br, 1, L/bc, 1)
    out.view(rows // br, br, cols // bc, bc).mul_(fp8.scale.view(rows // br, 1, cols // bc, 1))
    return out


def fp8_into(out: Tensor, codes: Tensor, tmp: Tensor) -> Tensor:
    """``out.copy_(codes)`` for NaN-free e4m3fn / e4m3fnuz codes in a third of the time, from the bits:
    the code's 7 low bits shifted into an fp32's exponent and mantissa fields are its value times
    2^-(127 - bias) (subnormals included), so one exact multiply by 2^(127 - bias) and the sign bit give it.
    ``tmp``: a buffer of ``out``'s shape."""
    bias = {torch.float8_e4m3fn: 7, torch.float8_e4m3fnuz: 8}.get(codes.dtype)
    if bias is None:
        return out.copy_(codes)
    bits, sign = out.view(torch.int32), tmp.view(torch.int32)
    bits.copy_(codes.view(torch.uint8))
    torch.bitwise_and(bits, 0x80, out=sign).bitwise_left_shift_(24)  # fnuz has no -0: 0x80 is its NaN
    bits.bitwise_and_(0x7F).bitwise_left_shift_(20).bitwise_or_(sign)
    return out.mul_(2.0 ** (127 - bias))


class Workspace:
    """Flat scratch buffers by role, grown on demand, handed out as views at offset 0 (the alignment a
    fresh tensor has). One per worker: the figures of one weight use them until the next weight."""

    def __init__(self) -> None:
        self._flat: dict[str, Tensor] = {}

    def get(self, role: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Tensor:
        count = math.prod(shape)
        buf = self._flat.get(role)
        if buf is None or buf.dtype != dtype or buf.numel() < count:
            buf = self._flat[role] = torch.empty(count, dtype=dtype)
        return buf[:count].view(shape)


@dataclass(frozen=True, eq=False)
class Measured:
    """One weight (N, K, M) and what every scheme's comparison needs of it (views into ``ws``)."""

    w: Tensor  # the exact value, fp32
    src: Tensor  # what the schemes quantize: w rounded to bf16, fp32 (``w`` itself when exact in bf16)
    mag: Tensor  # |src|
    norm: float
    zeros: int
    block_amax: Tensor | None  # (N, G, 1, M): amax of |src| over MX blocks along K (None: no MX scheme)
    stats: WeightStats
    ws: Workspace
    spec: Reference | None = None  # K not a multiple of the MX block: every figure from ``stats``


@torch.no_grad()
def measure(w: Tensor, ws: Workspace, *, bf16_exact: bool, mx_block: int | None = 32) -> Measured:
    """The scheme-independent figures of ``w`` (fp32 (N, K, M), contiguous; ``bf16_exact``: its values
    are bf16 values, as a bf16 checkpoint's are) = ``stats.weight_stats`` and ``stats.Reference.of``."""
    n, k, m = w.shape
    if mx_block is not None and k % mx_block:  # a ragged tail block: the padded formulation of stats
        return Measured(w, w, w, 0.0, 0, None, weight_stats(w), ws, Reference.of(w, mx_block))
    mag, tmp = ws.get("mag", (n, k, m)), ws.get("tmp", (n * k * m,))
    head_amax = torch.abs(w, out=mag).amax(dim=(1, 2)).double()  # (N,)
    # excess kurtosis exactly as bmm.theory.excess_kurtosis(w, float32), its temporary in ``tmp``
    v = w.reshape(-1)
    torch.sub(v, v.mean(), out=tmp).square_()
    var = float(tmp.mean())
    kurtosis = float(tmp.square_().mean()) / var**2 - 3.0 if var > 0 else 0.0
    amax = (float(head_amax.min()), float(head_amax.median()), float(head_amax.max()))
    stats = WeightStats(w.numel(), kurtosis, *amax)
    zero = ws.get("zero", (n, k, m), torch.bool)
    norm, zeros = float(torch.linalg.vector_norm(w)), int(torch.count_nonzero(torch.eq(w, 0, out=zero)))
    src = w
    if not bf16_exact:
        src = ws.get("src", (n, k, m)).copy_(w.to(torch.bfloat16))
        torch.abs(src, out=mag)
    block_amax = None
    if mx_block is not None:  # (N, K, M) -> (N, G, 32, M) -> (N, G, 1, M)
        block_amax = mag.view(n, k // mx_block, mx_block, m).amax(dim=2, keepdim=True)
    return Measured(w, src, mag, norm, zeros, block_amax, stats, ws)


@torch.no_grad()
def scheme_figures(ref: Measured, scheme: BmmScheme, prepared: PreparedWeight | None = None) -> SchemeError:
    """``stats.scheme_error`` of ``scheme``'s weight: ``prepared`` when given (the loader runs the
    checkpoint's own data), else the scheme's quantization of ``ref.w`` (computed here when it can be)."""
    if ref.spec is not None:
        return scheme_error(ref.spec, scheme.prepare(ref.w) if prepared is None else prepared, scheme.name)
    q = ref.ws.get("q", tuple(ref.w.shape))
    mx = None if prepared is not None else _quantize_into(q, ref, scheme)
    if mx is None:
        prepared = scheme.prepare(ref.w) if prepared is None else prepared
        q.copy_(prepared.dequantize(torch.float32))
        mx = _mx_scales(ref, prepared)
    return _error(ref, q, scheme.name, mx)


# (N, G, 1, M) fp32 block scales and the element max; () for a weight without MX blocks
MxScales = tuple[Tensor, float] | tuple[()]


def _quantize_into(q: Tensor, ref: Measured, scheme: BmmScheme) -> MxScales | None:
    """``scheme.prepare(ref.w).dequantize(float32)`` into ``q``; None where no fast path exists."""
    if isinstance(scheme, _AITER_FP8):
        codes, scale = vllm_batched_tensor_quant(ref.w, scheme.dtype, scheme.reduce_dims)
        fp8_into(q, codes, ref.ws.get("tmp", tuple(q.shape))).mul_(
            scale
        )  # (1|N, 1, 1|M) scale: the per-element product of Fp8Weight.dequantize
        return ()
    if isinstance(scheme, Fp8PerBlock):
        t = quantize_fp8(ref.src, scheme.dtype, (1, *scheme.block))
        fp8_into(q, t.codes, ref.ws.get("tmp", tuple(q.shape))).mul_(t.expanded_scale())
        return ()
    if isinstance(scheme, _MX) and ref.block_amax is not None:
        return _mx_into(q, ref, scheme.weight_elem, scheme.weight_rule)
    return None


def _mx_into(q: Tensor, ref: Measured, elem: MxElem, rule: ScaleRule) -> MxScales | None:
    """formats.quantize_mx(src, axis=1).dequantize(): u from the block amax, elements |src| * 2^-u
    rounded to the element grid (saturating at its max), the sign of src, times 2^u."""
    u = e8m0_scale_exponent(ref.block_amax, elem, rule)  # type: ignore[arg-type]  # (N, G, 1, M)
    if bool((u == E8M0_NAN - E8M0_BIAS).any()):
        return None  # a non-finite block: prepare() says so
    n, g, _, m = u.shape
    qb = q.view(n, g, -1, m)  # (N, K, M) -> (N, G, 32, M)
    inv = torch.exp2((-u).clamp(max=E8M0_BIAS).double()).float()  # 2^-u, exact in fp32
    torch.mul(ref.mag.view(qb.shape), inv, out=qb).clamp_(max=elem.max)
    round_magnitudes_(q, elem.mbits, EMIN[elem], ref.ws.get("tmp", tuple(q.shape)))
    torch.copysign(q, ref.src, out=q)
    scale = torch.exp2(u.double()).float()  # e8m0_decode of the byte u + 127
    qb.mul_(scale)
    return scale, elem.max


def round_magnitudes_(a: Tensor, mbits: int, emin: int, tmp: Tensor) -> Tensor:
    """Round finite non-negative fp32 ``a`` in place to the nearest value with ``mbits`` mantissa bits
    and exponent >= ``emin`` (subnormal spacing below), ties to even; ``tmp``: a buffer like ``a``.

    With e the exponent of a, C = 2^(max(e, emin) + 23 - mbits) has fp32 spacing 2^(max(e, emin) - mbits),
    the grid's spacing at a, and a + C stays in C's binade; so the fp32 add a + C rounds a to the grid,
    to even on a tie (the grid's even points are C's even mantissas), and subtracting C is exact."""
    c = tmp.view(torch.int32)
    torch.bitwise_and(a.view(torch.int32), 0x7F800000, out=c)  # a's exponent field
    c.clamp_(min=(emin + 127) << 23).add_((23 - mbits) << 23)
    return a.add_(tmp).sub_(tmp)


def _mx_scales(ref: Measured, prepared: PreparedWeight) -> MxScales:
    if not (isinstance(prepared, MxWeight) and prepared.mx.axis % 3 == 1 and ref.block_amax is not None):
        return ()
    mx = prepared.mx
    n, g, _, m = ref.block_amax.shape
    if tuple(mx.scales.shape) != (n, g, m):  # the reference was blocked by another block size
        raise ValueError(f"{prepared.scheme}: MX blocks of {mx.block_size} do not match the reference's")
    return e8m0_decode(mx.scales).view(n, g, 1, m), mx.elem.max


def _error(ref: Measured, q: Tensor, scheme: str, mx: MxScales) -> SchemeError:
    """stats.scheme_error's figures of ``q`` against ``ref``; ``q`` ends up holding the difference."""
    zero = ref.ws.get("zero", tuple(q.shape), torch.bool)
    n_nonzero = q.numel() - ref.zeros
    q_zeros = int(torch.count_nonzero(torch.eq(q, 0, out=zero)))
    flushed = (q_zeros - ref.zeros) / n_nonzero if n_nonzero else 0.0
    flush_blocks = saturate_blocks = None
    if mx:
        scale, elem_max = mx
        n, g, _, m = scale.shape
        # a block with an element that q zeroes but src does not (src 0 -> q 0): |src| > 0 where q is 0
        lost = torch.where(zero, ref.mag, torch.zeros(()), out=ref.ws.get("tmp", tuple(q.shape)))
        flushed_b = lost.view(n, g, -1, m).amax(dim=2) > 0  # (N, G, M)
        saturated = ref.block_amax > elem_max * scale  # type: ignore[operator]  # (N, G, 1, M)
        blocks = flushed_b.numel()
        flush_blocks = int(torch.count_nonzero(flushed_b)) / blocks
        saturate_blocks = int(torch.count_nonzero(saturated)) / blocks
    diff = q.sub_(ref.w)
    rel = float(torch.linalg.vector_norm(diff)) / ref.norm if ref.norm > 0 else 0.0
    lo, hi = torch.aminmax(diff)
    theory = theory_for(scheme)
    predicted = None if theory is None else theory.with_weight_error(rel).product
    return SchemeError(rel, max(-float(lo), float(hi)), flushed, flush_blocks, saturate_blocks, predicted)

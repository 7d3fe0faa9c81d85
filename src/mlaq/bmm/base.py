"""The contract every absorbed-MLA batched-matmul scheme fulfils.

MLA decode runs two batched matmuls over heads, both of the form ``y[n] = x[n] @ w[n]``:
  q absorption     x = q_nope   (N, B, P)  @  w = W_UK      (N, P, L)  ->  (N, B, L)
  V up-projection  x = o_latent (N, B, L)  @  w = W_UV^T    (N, L, V)  ->  (N, B, V)
so a scheme sees a weight of shape (N, K, M) and activations of shape (N, B, K); K is the reduction
axis, and every block/group quantization in a scheme runs along K (as the engines' kernels do).

A scheme quantizes the weight ONCE in ``prepare`` (at load) and emulates the named kernel's
arithmetic in ``apply``: exact dequantization, fp32 accumulation, output rounded as the engine does.
``apply`` returns float32 tensors whose values are already rounded to ``out_dtype`` so that callers
can stay in fp32 without losing the emulation.

Accumulation: a kernel accumulates in fp32 in an order of its own (tiles, split-K), so no single
fp32 order is "the" kernel's. Every emulation here forms the dot products exactly (in float64,
where products of the quantized operands are exact and their sums all but always are) and rounds
once to fp32: the correctly rounded value, which every fp32 order approaches within Higham's bound
(``check_kernel`` uses it). A side effect the engines' per-token schemes share: a row's result does
not depend on the other rows of the batch (torch's fp32 CPU bmm does not give that: its blocking,
and so its summation order, changes with the batch size).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

import torch
from torch import Tensor


@dataclass(frozen=True)
class PreparedWeight:
    """A weight after ``BmmScheme.prepare``; subclasses add codes and scales."""

    scheme: str
    shape: tuple[int, int, int]  # (N, K, M)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight the scheme effectively multiplies by, (N, K, M), rounded once to ``dtype``.

        ``torch.float64`` gives the exact value for every scheme in mlaq (an fp8 code times an fp32
        scale needs up to 28 significant bits, so it is not always exact in float32).
        """
        raise NotImplementedError

    def storage_bytes(self) -> int:
        """Bytes a kernel reads for this weight: codes plus scales at their real granularity."""
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class DenseWeight(PreparedWeight):
    """A weight kept in a plain floating dtype (the reference schemes)."""

    weight: Tensor  # (N, K, M), in the scheme's storage dtype
    values: Tensor | None = field(default=None, repr=False)  # float64 copy for the emulation (set at load)

    def __post_init__(self) -> None:
        if self.values is None:
            object.__setattr__(self, "values", self.weight.double())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return self.weight.to(dtype)

    def storage_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class BmmScheme(ABC):
    """A named batched-matmul arithmetic; instances are stateless and hashable by name."""

    # name and description may be set per instance (e.g. the e4m3fnuz variants of the fp8 schemes).
    name: str
    out_dtype: ClassVar[torch.dtype]
    description: str  # the exact arithmetic, one sentence, for reports
    # Whether torch.compile (inductor, CPU) reproduces ``apply`` bit for bit: then ``compile=True`` runs
    # the scheme inside its compiled pieces (tests/test_bmm_compiled.py checks every scheme that says so).
    compiles_exactly: ClassVar[bool] = False
    # Whether a token's result is independent of the other tokens of its batch (False: SGLang's bmm_fp8
    # path, whose activation scale is the whole batch's amax).
    batch_invariant: ClassVar[bool] = True

    @abstractmethod
    def prepare(self, weight: Tensor) -> PreparedWeight:
        """Quantize a (N, K, M) weight once, at load."""

    @abstractmethod
    def apply(self, x: Tensor, prepared: PreparedWeight) -> Tensor:
        """(N, B, K) activations times the prepared weight -> float32 (N, B, M), rounded to out_dtype."""

    def activation_values(self, x: Tensor) -> Tensor:
        """The activations the kernel multiplies by (after its dynamic quantization), float64 (N, B, K).

        Exact; used by ``check_kernel`` for the fp32-accumulation error bound and by reports.
        """
        raise NotImplementedError(f"{self.name} does not expose its activation values")

    def __call__(self, x: Tensor, weight: Tensor) -> Tensor:
        """Prepare and apply in one go (tests, benchmarks); layers keep the prepared weight."""
        return self.apply(x, self.prepare(weight))

    def __repr__(self) -> str:
        return f"<BmmScheme {self.name}>"


def check_operands(x: Tensor, prepared: PreparedWeight) -> None:
    """Shape check shared by every scheme: x (N, B, K) against a (N, K, M) weight."""
    n, k, _ = prepared.shape
    if x.dim() != 3 or x.shape[0] != n or x.shape[2] != k:
        raise ValueError(
            f"{prepared.scheme}: activations of shape {tuple(x.shape)} do not fit a weight of shape "
            f"{prepared.shape}; expected (N={n}, B, K={k})"
        )


W = TypeVar("W", bound=PreparedWeight)


def own_weight(scheme: BmmScheme, prepared: PreparedWeight, kind: type[W]) -> W:
    """``prepared`` as ``kind``, checked to come from ``scheme``'s own ``prepare``: a weight prepared
    by another scheme holds other codes and scales, so applying it would silently compute nonsense."""
    if not isinstance(prepared, kind) or prepared.scheme != scheme.name:
        raise ValueError(f"{scheme.name} needs a weight prepared by {scheme.name}, got {prepared.scheme}")
    return prepared


class Fp32Reference(BmmScheme):
    """Plain fp32 matmul: the noise-floor reference for tests and reports."""

    name = "fp32"
    out_dtype = torch.float32
    compiles_exactly = True
    description = "fp32 weights and activations, exact products summed and rounded once to fp32"

    def prepare(self, weight: Tensor) -> PreparedWeight:
        return DenseWeight(self.name, tuple(weight.shape), weight.detach().float().contiguous())

    def apply(self, x: Tensor, prepared: PreparedWeight) -> Tensor:
        check_operands(x, prepared)
        assert isinstance(prepared, DenseWeight)
        return torch.bmm(x.float().double(), prepared.values).float()

    def activation_values(self, x: Tensor) -> Tensor:
        return x.float().double()


class Bf16Reference(BmmScheme):
    """What every engine runs by default: bf16 operands, fp32 accumulation, bf16 output."""

    name = "bf16"
    out_dtype = torch.bfloat16
    compiles_exactly = True
    description = "bf16 weights and activations, fp32 accumulation, output rounded to bf16"

    def prepare(self, weight: Tensor) -> PreparedWeight:
        w = weight.detach().to(torch.bfloat16).contiguous()
        return DenseWeight(self.name, tuple(weight.shape), w)

    def apply(self, x: Tensor, prepared: PreparedWeight) -> Tensor:
        check_operands(x, prepared)
        assert isinstance(prepared, DenseWeight)
        # bf16 products are exact in float64 (and fp32); the sum is rounded once to fp32, then bf16.
        acc = torch.bmm(x.to(torch.bfloat16).double(), prepared.values).float()
        return acc.to(torch.bfloat16).float()

    def activation_values(self, x: Tensor) -> Tensor:
        return x.to(torch.bfloat16).double()

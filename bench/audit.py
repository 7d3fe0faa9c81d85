"""Benchmark of ``mlaq audit`` on full-size synthetic DeepSeek-V3 checkpoints (bf16 and block FP8).

For each checkpoint (built by bench/synthetic_checkpoint.py if absent: 163 sparse shards, index.json,
61 + 1 MLA layers, only kv_b_proj holds data):
- wall time and process CPU time (user + sys, all threads) of ``mlaq.audit.audit`` for two schemes,
  ``--workers`` layers at once (threads of this process: /proc/self/io counts them all);
- bytes the reader counted, against kv_b_proj weights + scales + shard headers (goal: <= 1.05 x);
- the process's own read counters (/proc/self/io ``rchar``: every byte a read syscall returned, page
  cache or not, holes included) around the audit, against the reader's count plus the small JSON files
  (config.json, the index) that the policy and the reader parse. The shards are dropped from the page
  cache first (posix_fadvise DONTNEED) so ``read_bytes`` shows what came from the disk.

    python bench/audit.py [--dir ~/.cache/mlaq-bench] [--schemes fp8_per_tensor,mxfp4] [--workers 2]
Results, with the machine named: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_checkpoint import write

from mlaq.audit import RangeReader, audit
from mlaq.settings import Settings


def proc_io() -> dict[str, int]:
    lines = Path("/proc/self/io").read_text().split("\n")
    return {k: int(v) for k, v in (line.split(": ") for line in lines if line)}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def drop_cache(directory: Path) -> None:
    for file in directory.glob("*.safetensors"):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_one(directory: Path, schemes: tuple[str, ...], workers: int) -> dict:
    json_bytes = sum(
        f.stat().st_size for f in (directory / "config.json", directory / "model.safetensors.index.json")
    )
    drop_cache(directory)
    reader = RangeReader()
    load0 = os.getloadavg()[0]
    io0, ru0, t0 = proc_io(), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    r = audit(directory, schemes, Settings(), reader=reader, workers=workers)
    wall, ru1, io1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF), proc_io()
    user, sys_ = ru1.ru_utime - ru0.ru_utime, ru1.ru_stime - ru0.ru_stime
    io = r["io"]
    needed = io["kv_b_weight_bytes"] + io["scale_bytes"] + io["header_bytes"]
    rchar = io1["rchar"] - io0["rchar"]
    return {
        "checkpoint": directory.name,
        "layers": len(r["layers"]),
        "schemes": list(schemes),
        "workers": workers,
        "wall_s": round(wall, 1),
        "cpu_s": round(user + sys_, 1),  # user + sys of every thread of the process
        "user_s": round(user, 1),
        "sys_s": round(sys_, 1),
        "load_before": round(load0, 1),
        "reader_bytes": reader.bytes_read,
        "kv_b_weight_bytes": io["kv_b_weight_bytes"],
        "scale_bytes": io["scale_bytes"],
        "header_bytes": io["header_bytes"],
        "reader_over_needed": round(reader.bytes_read / needed, 4),
        "rchar": rchar,
        "json_bytes_per_parse": json_bytes,
        "rchar_minus_reader": rchar - reader.bytes_read,
        "read_bytes_from_disk": io1["read_bytes"] - io0["read_bytes"],
        "files_read": io["files_read"],
        "files_in_checkpoint": io["files_in_checkpoint"],
        "apparent_checkpoint_bytes": sum(f.stat().st_size for f in directory.glob("*.safetensors")),
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "riskiest_layers": r["ranking"][:5],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache/mlaq-bench")
    ap.add_argument("--schemes", default="fp8_per_tensor,mxfp4")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    schemes = tuple(args.schemes.split(","))
    print(
        f"machine: {cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
        f"(the audit runs each layer on 1 thread, {args.workers} at once), 1-min load {os.getloadavg()[0]:.1f}",
        file=sys.stderr,
    )
    results = []
    for name, fp8 in (("dsv3-bf16", False), ("dsv3-fp8", True)):
        directory = args.dir / name
        if not (directory / "model.safetensors.index.json").is_file():
            print(f"writing {directory} ...", file=sys.stderr)
            write(directory, fp8)
        res = bench_one(directory, schemes, args.workers)
        res["load_after"] = round(os.getloadavg()[0], 1)
        results.append(res)
        print(json.dumps(res), flush=True)
        ok = (
            res["reader_over_needed"] <= 1.05 and res["rchar_minus_reader"] <= 4 * res["json_bytes_per_parse"]
        )
        print(f"{name}: {'OK' if ok else 'OVER BUDGET'} bytes; {res['wall_s']} s wall", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

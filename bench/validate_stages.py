"""Stage times of ``mlaq validate`` (the in-memory engine source): wall and CPU (user+sys) per stage.

    python bench/validate_stages.py [MODEL] [any mlaq validate option] [--torch-ops N] [--stages-json PATH]

Parses the arguments with validate's own parser (same defaults), then runs the same code
(``EngineSource.measure``, ``summarize``, the report writer, the terminal summary) with timers wrapped
around its stages:
- reference capture: the bf16 reference's teacher-forced pass that records every layer's inputs
  (MTP layer included), once per window;
- teacher-forced stream: every other variant's whole-window forward (KL, top-1, ΔNLL);
- per-layer attention: each layer's attention replayed on the captured inputs;
- flips: the reference's sampled attention rows and each variant's comparison;
- per-op: operand statistics and per-BMM errors on the first window;
- generation (MTP drafting inside it shown apart); task suite; report (summary, files, table);
- other: the rest (loading, tokenizing, drawing task samples, glue).
CPU time is the process's (all threads); on a loaded machine it is the figure to compare, wall
time is not. ``--torch-ops N`` profiles the run with torch.profiler and prints the N ops with the
most self CPU time (the profiler slows the run: stage times are then not comparable).
Not a test: figures depend on the machine and its load (both printed).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from mlaq.cli import validate as validate_cli
from mlaq.libc import keep_freed_memory
from mlaq.model import DeepseekForCausalLM
from mlaq.validate.sources import engine as engine_source
from mlaq.validate.sources import windows as windows_source

STAGES = (
    "reference capture",
    "teacher-forced stream",
    "per-layer attention",
    "flips",
    "per-op",
    "generation",
    "  of which MTP drafting",
    "task suite",
    "report",
)
NESTED = ("  of which MTP drafting",)


class Clock:
    """Wall and process CPU seconds per stage; a nested stage is also counted in its parent."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.stack: list[str] = []

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        w, c = time.perf_counter(), time.process_time()
        self.stack.append(name)
        try:
            yield
        finally:
            self.stack.pop()
            self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - w
            self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - c

    def wrap(self, fn: Callable, name: str, *, inside: str | None = None) -> Callable:
        """``fn`` timed as ``name`` (only while stage ``inside`` runs, when given)."""

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if inside is not None and inside not in self.stack:
                return fn(*args, **kwargs)
            with self.stage(name):
                return fn(*args, **kwargs)

        return timed


@contextlib.contextmanager
def instrumented(clock: Clock) -> Iterator[None]:
    """Timers around the engine source's stage functions (restored afterwards)."""
    mod, win = engine_source, windows_source
    patches = {
        (win, "capture_reference"): "reference capture",
        (win, "_teacher_forced_logits"): "teacher-forced stream",
        (win, "project_input"): "per-layer attention",
        (win, "attention_output"): "per-layer attention",
        (win, "flip_reference"): "flips",
        (win, "_add_flips"): "flips",
        (win, "exact"): "per-op",
        (win, "operand_stats"): "per-op",
        (win, "op_errors"): "per-op",
        (mod, "generate"): "generation",
        (mod.tasks, "score"): "task suite",
    }
    saved = {}
    for (owner, attr), name in patches.items():
        saved[owner, attr] = getattr(owner, attr)
        setattr(owner, attr, clock.wrap(saved[owner, attr], name))
    mtp = DeepseekForCausalLM.mtp_step
    DeepseekForCausalLM.mtp_step = clock.wrap(mtp, "  of which MTP drafting", inside="generation")
    try:
        yield
    finally:
        for (owner, attr), fn in saved.items():
            setattr(owner, attr, fn)
        DeepseekForCausalLM.mtp_step = mtp


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def run(args: argparse.Namespace, torch_ops: int) -> tuple[Clock, dict, float, float]:
    from mlaq.validate.progress import NullProgress
    from mlaq.validate.report import write_report
    from mlaq.validate.runner import measure
    from mlaq.validate.stats import summarize
    from mlaq.validate.summary import print_summary
    from mlaq.validate.verdict import VerdictConfig

    config = validate_cli.config_from_args(args)
    keep_freed_memory()  # as the CLI does for an in-memory run
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = Clock()
    w0, c0 = time.perf_counter(), time.process_time()
    profiler = (
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        if torch_ops
        else contextlib.nullcontext()
    )
    with profiler as prof, instrumented(clock):
        record = measure(config, progress=NullProgress())
        with clock.stage("report"):
            report = summarize(record, VerdictConfig(max_drop=args.max_drop, max_kl=args.max_kl))
            with tempfile.TemporaryDirectory() as tmp:
                write_report(report, args.out or tmp)
            with contextlib.redirect_stdout(io.StringIO()):
                print_summary(report)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    top = [n for n in clock.wall if n not in NESTED]
    clock.wall["other (load, tokenize, glue)"] = wall - sum(clock.wall[n] for n in top)
    clock.cpu["other (load, tokenize, glue)"] = cpu - sum(clock.cpu[n] for n in top)
    if torch_ops:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=torch_ops))
    return clock, record.config, wall, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    validate_cli.add_arguments(parser)
    parser.add_argument("--torch-ops", type=int, default=0, metavar="N", help="print the top N torch ops")
    parser.add_argument("--stages-json", metavar="PATH", help="also write the stage times as JSON")
    args = parser.parse_args(argv)
    load0 = os.getloadavg()
    clock, cfg, wall, cpu = run(args, args.torch_ops)
    load1 = os.getloadavg()
    print(f"cpu: {cpu_name()}, {os.cpu_count()} cores; torch {torch.__version__}, {cfg['threads']} thread(s)")
    print(f"load average before {load0[0]:.2f} / after {load1[0]:.2f} (1 min)")
    print(f"command: validate {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"{'stage':<26}{'wall s':>9}{'cpu s':>9}")
    for name in (*STAGES, "other (load, tokenize, glue)"):
        if name in clock.wall:
            print(f"{name:<26}{clock.wall[name]:>9.1f}{clock.cpu[name]:>9.1f}")
    print(f"{'total':<26}{wall:>9.1f}{cpu:>9.1f}")
    if args.stages_json:
        out = {
            "cpu": cpu_name(),
            "threads": cfg["threads"],
            "load": [load0[0], load1[0]],
            "argv": sys.argv[1:] if argv is None else argv,
            "stages": {n: {"wall": clock.wall[n], "cpu": clock.cpu[n]} for n in clock.wall},
            "total": {"wall": wall, "cpu": cpu},
        }
        Path(args.stages_json).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

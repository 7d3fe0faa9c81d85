"""Bounded load on ``mlaq serve``: C concurrent streaming clients x R requests each, for several rounds,
on 127.0.0.1; and ``mlaq.LLM`` offline on the same prompts in the same run (server overhead as a ratio).

Checks (the script exits 1 if one fails): 0 errors, every request finishes with max_tokens tokens
(ignore_eos) and usage says so, the server's vllm:generation_tokens_total moved by exactly the tokens
the clients counted, and the server's RSS does not grow across rounds after the first (warm-up)
beyond --rss-slack-mb. Reports throughput, p50/p99 time-to-first-token and inter-token latency.

    PYTHONPATH=src python bench/serve_load.py --clients 32 --requests 2 --rounds 3 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """The process's resident set (VmRSS) or its peak (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pid: int) -> float:
    """user + sys CPU seconds the process has used (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gen_tokens(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("vllm:generation_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def prompts_from(text: str, n: int, chars: int) -> list[str]:
    step = max((len(text) - chars) // n, 1)
    return [text[i * step : i * step + chars] for i in range(n)]


async def one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    start = time.perf_counter()
    stamps, usage, error, finish = [], None, None, None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]["message"]
            elif chunk["choices"]:
                # a chunk carries the tokens of one engine step (text may be held back: count arrivals)
                stamps.append(time.perf_counter())
                finish = chunk["choices"][0]["finish_reason"] or finish
            else:
                usage = chunk["usage"]
    if error or usage is None:
        return {"error": error or "no usage chunk"}
    itl = [b - a for a, b in itertools.pairwise(stamps)]
    return {
        "ttft": stamps[0] - start,
        "itl": itl,
        "tokens": usage["completion_tokens"],
        "finish": finish,
        "e2e": time.perf_counter() - start,
    }


async def round_(url: str, prompts: list[str], clients: int, requests: int, max_tokens: int) -> list[dict]:
    limits = httpx.Limits(max_connections=clients + 4)
    # one connection per request: a kept-alive connection that idles past uvicorn's keep-alive timeout
    # (5 s, as vLLM's) while this client is starved of CPU is closed by the server with the next
    # request already in its buffer, a client-side ReadError that says nothing about the server
    headers = {"Connection": "close"}
    async with httpx.AsyncClient(timeout=600, limits=limits, headers=headers) as client:

        async def worker(c: int) -> list[dict]:
            out = []
            for r in range(requests):
                try:
                    out.append(await one(client, url, prompts[(c * requests + r) % len(prompts)], max_tokens))
                except Exception as exc:
                    out.append({"error": f"{type(exc).__name__}: {exc}"})
            return out

        results = await asyncio.gather(*(worker(c) for c in range(clients)))
    return [x for r in results for x in r]


def offline(model: str, dtype: str, prompts: list[str], max_tokens: int, max_num_seqs: int) -> dict:
    import torch

    from mlaq.engine.llm import LLM
    from mlaq.engine.sampling_params import SamplingParams

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    llm = LLM(model, max_num_seqs=max_num_seqs, dtype=None if dtype == "auto" else getattr(torch, dtype))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], params)  # warm-up
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "requests": len(prompts), "tokens": tokens, "seconds": seconds, "cpu_seconds": cpu,
        "tok_per_s": tokens / seconds, "tok_per_cpu_s": tokens / cpu,
    }  # fmt: skip


def start_server(model: str, dtype: str, max_num_seqs: int, log: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "mlaq", "serve", model, "--port", "0", "--max-num-seqs", str(max_num_seqs)]
    cmd += ["--dtype", dtype]
    cmd += ["--uvicorn-log-level", "info"]  # its start-up line (the port) is logged at info
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        m = re.search(r"on http://127\.0\.0\.1:(\d+)", log.read_text())
        if m:
            url = f"http://127.0.0.1:{m.group(1)}"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
        if proc.poll() is not None:
            raise SystemExit("mlaq serve exited:\n" + log.read_text())
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("mlaq serve did not start")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    ap.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=2, help="requests per client per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-chars", type=int, default=300)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument(
        "--time-limit", type=float, default=1200, help="no new round starts after this many seconds"
    )
    ap.add_argument("--rss-slack-mb", type=float, default=64)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from mlaq.validate.config import bundled_model_dir

    model = args.model or str(bundled_model_dir())
    heldout = Path(model) / "heldout.txt"
    text = heldout.read_text(encoding="utf-8") if heldout.is_file() else "the " * 5000
    prompts = prompts_from(text, args.clients * args.requests, args.prompt_chars)

    load_before = os.getloadavg()
    off = offline(model, args.dtype, prompts, args.max_tokens, args.max_num_seqs)
    print(
        f"offline mlaq.LLM: {off['tokens']} tokens in {off['seconds']:.1f} s = {off['tok_per_s']:.1f} tok/s "
        f"({off['cpu_seconds']:.1f} CPU s)"
    )
    log = Path(args.out or "/tmp/serve_load").with_suffix(".server.log")
    proc, url = start_server(model, args.dtype, args.max_num_seqs, log)
    began, rounds, failures = time.perf_counter(), [], []
    try:
        asyncio.run(round_(url, prompts[:4], 4, 1, 4))  # warm-up, not counted
        for k in range(args.rounds):
            if time.perf_counter() - began > args.time_limit:
                failures.append(f"time limit reached after {k} rounds")
                break
            before, cpu = gen_tokens(url), cpu_seconds(proc.pid)
            start = time.perf_counter()
            results = asyncio.run(round_(url, prompts, args.clients, args.requests, args.max_tokens))
            seconds = time.perf_counter() - start
            cpu = cpu_seconds(proc.pid) - cpu
            moved = gen_tokens(url) - before
            ok = [r for r in results if "error" not in r]
            errors = [r["error"] for r in results if "error" in r]
            tokens = sum(r["tokens"] for r in ok)
            row = {
                "round": k,
                "requests": len(results),
                "errors": len(errors),
                "first_errors": errors[:3],
                "tokens": tokens,
                "server_counted": moved,
                "all_full_length": all(
                    r["tokens"] == args.max_tokens and r["finish"] == "length" for r in ok
                ),
                "seconds": seconds,
                "server_cpu_seconds": cpu,
                "tok_per_s": tokens / seconds,
                "tok_per_cpu_s": tokens / cpu if cpu else float("nan"),
                "ttft_p50": percentile([r["ttft"] for r in ok], 0.5),
                "ttft_p99": percentile([r["ttft"] for r in ok], 0.99),
                "itl_p50": percentile([x for r in ok for x in r["itl"]], 0.5),
                "itl_p99": percentile([x for r in ok for x in r["itl"]], 0.99),
                "rss_mb": rss_mb(proc.pid),
                "peak_rss_mb": rss_mb(proc.pid, "VmHWM"),
                "loadavg_1m": os.getloadavg()[0],
            }
            rounds.append(row)
            print(json.dumps({k2: round(v, 4) if isinstance(v, float) else v for k2, v in row.items()}))
            if errors:
                failures.append(f"round {k}: {len(errors)} errors, e.g. {errors[0]}")
            if tokens != moved or tokens != len(results) * args.max_tokens or not row["all_full_length"]:
                failures.append(f"round {k}: tokens not accounted ({tokens} counted, server {moved})")
    finally:
        proc.terminate()
        proc.wait(60)
    if len(rounds) >= 3:
        growth = rounds[-1]["rss_mb"] - rounds[1]["rss_mb"]
        if growth > args.rss_slack_mb:
            failures.append(f"RSS grew by {growth:.0f} MB after warm-up (slack {args.rss_slack_mb} MB)")
    if rounds:
        serve_tps = statistics.median(r["tok_per_s"] for r in rounds)
        summary = {
            "offline": off,
            "rounds": rounds,
            "serve_tok_per_s_median": serve_tps,
            "serve_over_offline": serve_tps / off["tok_per_s"],
            # per CPU second of the serving process: the same ratio, less sensitive to a shared machine
            "serve_over_offline_cpu": statistics.median(r["tok_per_cpu_s"] for r in rounds)
            / off["tok_per_cpu_s"],
            "failures": failures,
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "args": vars(args),
        }
        print(
            f"serve {serve_tps:.1f} tok/s vs offline {off['tok_per_s']:.1f} tok/s: ratio "
            f"{summary['serve_over_offline']:.3f} (per CPU second: {summary['serve_over_offline_cpu']:.3f})"
        )
        if args.out:
            Path(args.out).write_text(json.dumps(summary, indent=2))
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

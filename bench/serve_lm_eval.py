"""lm-eval's ``local-completions`` against ``mlaq serve``, on local data only (no hub download).

Builds two tasks from the bundled model's held-out text (or --text FILE) into OUT/tasks:
- ``mlaq_next_chunk`` (loglikelihood, multiple choice): a context window, and which of 4 candidate
  continuations (the true one and 3 from elsewhere in the text) the model scores highest: acc, acc_norm;
- ``mlaq_continue`` (generate_until): greedy continuation of a context up to a newline, exact match
  and the first-word match against the text's own continuation.
Then starts ``mlaq serve`` on a free 127.0.0.1 port and runs

    lm_eval run --model local-completions --tasks mlaq_next_chunk mlaq_continue --include_path OUT/tasks \\
        --model_args model=NAME,base_url=http://127.0.0.1:PORT/v1/completions,tokenizer_backend=remote,\\
                     num_concurrent=4,max_retries=1,tokenized_requests=True

(loglikelihood goes through echo + logprobs with token-id prompts; the tokenizer is the server's
/tokenize, /detokenize and /tokenizer_info). lm-eval lives in its own environment (--lm-eval BIN):

    python -m venv /work/lmeval-venv       # sees mlaq's venv (its CPU torch) through a .pth file, so
    python -c "import site; print(site.getsitepackages()[0])" > /work/lmeval-venv/lib/python3.11/site-packages/mlaq.pth
    /work/lmeval-venv/bin/pip install "lm-eval[api]"   # pip then keeps that torch (no CUDA build)
    PYTHONPATH=src python bench/serve_lm_eval.py --lm-eval /work/lmeval-venv/bin/lm_eval --out /tmp/lmeval

Prints lm-eval's table and writes OUT/summary.json (each accuracy with its sample count and a 95 %
Wilson interval).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LL_YAML = """task: mlaq_next_chunk
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
metadata:
  version: 1.0
"""

GEN_YAML = """task: mlaq_continue
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 24
  do_sample: false
  temperature: 0
filter_list:
  - name: first_word
    filter:
      - function: regex
        regex_pattern: "^\\\\s*(\\\\S+)"
      - function: take_first
metric_list:
  - metric: exact_match
    ignore_case: false
    ignore_punctuation: false
metadata:
  version: 1.0
"""


def build_tasks(text: str, out: Path, n_ll: int, n_gen: int, context_chars: int, seed: int) -> Path:
    rng = random.Random(seed)
    lines = [ln for ln in text.splitlines() if len(ln.strip()) >= 12]
    tasks = out / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    ll, gen = [], []
    starts = list(range(context_chars, len(text) - 200))
    for _ in range(n_ll):
        i = rng.choice(starts)
        i = text.rfind(" ", 0, i) + 1 or i  # cut at a word boundary
        true = text[i : i + 24]
        others = [text[j : j + 24] for j in rng.sample(starts, 3)]
        choices = [true, *others]
        rng.shuffle(choices)
        ll.append({"context": text[i - context_chars : i], "choices": choices, "label": choices.index(true)})
    offsets, pos = [], 0
    for ln in text.splitlines(keepends=True):
        offsets.append(pos)
        pos += len(ln)
    eligible = [
        k for k, ln in enumerate(text.splitlines()) if len(ln.strip()) >= 12 and offsets[k] > context_chars
    ]
    for k in rng.sample(eligible, min(n_gen, len(eligible))):
        line = text.splitlines()[k]
        cut = max(line.find(" ", len(line) // 2), 1)
        context = text[offsets[k] - context_chars : offsets[k]] + line[:cut]
        gen.append(
            {"context": context, "target": line[cut:].strip().split(" ")[0] if line[cut:].strip() else ""}
        )
    del lines
    (tasks / "ll.jsonl").write_text("".join(json.dumps(d) + "\n" for d in ll))
    (tasks / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in gen))
    (tasks / "mlaq_next_chunk.yaml").write_text(LL_YAML.format(data=tasks / "ll.jsonl"))
    (tasks / "mlaq_continue.yaml").write_text(GEN_YAML.format(data=tasks / "gen.jsonl"))
    return tasks


def wilson(k: float, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (c - h, c + h)


def start_server(model: str | None, name: str, extra: list[str], log: Path) -> tuple[subprocess.Popen, int]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    cmd = [sys.executable, "-m", "mlaq", "serve", *([model] if model else []), "--port", "0"]
    cmd += ["--served-model-name", name, *extra]
    handle = log.open("w")
    proc = subprocess.Popen(cmd, stderr=subprocess.STDOUT, stdout=handle, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        text = log.read_text()
        m = re.search(r"on http://127\.0\.0\.1:(\d+)", text)
        if m and "startup complete" in text:
            return proc, int(m.group(1))
        if proc.poll() is not None:
            raise SystemExit(f"mlaq serve exited:\n{text}")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("mlaq serve did not start in 600 s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lm-eval", default="lm_eval", help="the lm_eval executable (its own venv)")
    ap.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    ap.add_argument("--text", default=None, help="evaluation text (default: the bundled model's heldout.txt)")
    ap.add_argument("--out", default="/tmp/mlaq-lmeval")
    ap.add_argument("--n-ll", type=int, default=100)
    ap.add_argument("--n-gen", type=int, default=40)
    ap.add_argument("--context-chars", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-arg", action="append", default=[], help="extra flag for mlaq serve (repeatable)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.text:
        text_path = Path(args.text)
    else:
        sys.path.insert(0, str(ROOT / "src"))
        from mlaq.validate.config import bundled_model_dir

        text_path = bundled_model_dir() / "heldout.txt"
    tasks = build_tasks(
        text_path.read_text(encoding="utf-8"), out, args.n_ll, args.n_gen, args.context_chars, args.seed
    )
    name = "mlaq-model"
    proc, port = start_server(args.model, name, args.serve_arg, out / "server.log")
    try:
        model_args = (
            f"model={name},base_url=http://127.0.0.1:{port}/v1/completions,tokenizer_backend=remote,"
            "num_concurrent=4,max_retries=1,tokenized_requests=True"
        )
        cmd = [
            args.lm_eval, "run", "--model", "local-completions", "--model_args", model_args,
            "--tasks", "mlaq_next_chunk", "mlaq_continue", "--include_path", str(tasks),
            "--output_path", str(out / "results"), "--seed", str(args.seed),
        ]  # fmt: skip
        env = {
            **os.environ,
            "HF_DATASETS_OFFLINE": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        start = time.perf_counter()
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        (out / "lm_eval.log").write_text(run.stdout + run.stderr)
        print(run.stdout[-4000:])
        if run.returncode != 0:
            print(run.stderr[-4000:], file=sys.stderr)
            return run.returncode
    finally:
        proc.terminate()
        proc.wait(60)
    results = json.loads(sorted((out / "results").rglob("results_*.json"))[-1].read_text())["results"]
    summary = {"lm_eval_seconds": round(seconds, 1), "port": port, "tasks": {}}
    for task, n in (("mlaq_next_chunk", args.n_ll), ("mlaq_continue", args.n_gen)):
        for key, value in results[task].items():
            if isinstance(value, float) and "stderr" not in key:
                lo, hi = wilson(value * n, n)
                summary["tasks"][f"{task}/{key}"] = {"value": value, "n": n, "ci95": [lo, hi]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Write mlaq-tiny-4k's model card (README.md) from its config, training record and held-out figures.

    python scripts/tiny4k_card.py --eval build/tiny4k-eval.json [--model DIR] [--peak-gflops X]

Training speed is given as tokens/s and as MFU: model FLOPs per token (6 x active matmul parameters,
plus causal attention at each phase's length) x tokens/s over the matmul FLOP/s this machine reaches
on one thread (measured here with --measure-peak, or given with --peak-gflops).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[1]


def active_matmul_params(c: dict) -> int:
    """Parameters one token multiplies through in training: main layers, MTP layer, both LM heads."""
    h, nh = c["hidden_size"], c["num_attention_heads"]
    qk, v, lora, rope = (
        c["qk_nope_head_dim"] + c["qk_rope_head_dim"],
        c["v_head_dim"],
        c["kv_lora_rank"],
        c["qk_rope_head_dim"],
    )
    attn = h * c["q_lora_rank"] + c["q_lora_rank"] * nh * qk + h * (lora + rope)
    attn += lora * nh * (c["qk_nope_head_dim"] + v) + nh * v * h
    dense = 3 * h * c["intermediate_size"]
    moe = 3 * h * c["moe_intermediate_size"] * (c["num_experts_per_tok"] + c["n_shared_experts"])
    moe += h * c["n_routed_experts"]
    n, k = c["num_hidden_layers"], c["first_k_dense_replace"]
    main = n * attn + k * dense + (n - k) * moe
    mtp = attn + moe + 2 * h * h
    return main + mtp + 2 * h * c["vocab_size"]


def attention_flops(c: dict, seq: int) -> float:
    """Training FLOPs per token of causal attention (QK^T and PV, fwd + bwd = 3x fwd), 5 MLA layers."""
    nh, qk, v = c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["v_head_dim"]
    layers = c["num_hidden_layers"] + c.get("num_nextn_predict_layers", 1)
    return 3 * layers * 2 * nh * (qk + v) * seq / 2


def measure_peak(dtype: torch.dtype, n: int = 1024, reps: int = 10) -> float:
    torch.set_num_threads(1)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9


def phase_rows(meta: dict, c: dict, peak: float) -> list[str]:
    hist = meta["history"]
    rows = []
    for seq in sorted({r["seq"] for r in hist}):
        pts = [r for r in hist if r["seq"] == seq]
        if len(pts) < 2:
            continue
        toks = pts[-1]["tokens"] - pts[0]["tokens"]
        secs = (pts[-1]["min"] - pts[0]["min"]) * 60
        tps = toks / secs
        flops = 6 * active_matmul_params(c) + attention_flops(c, seq)
        rows.append(f"| {seq} | {tps:,.0f} | {flops / 1e6:.1f} | {tps * flops / 1e9 / peak:.0%} |")
    return rows


def runs(meta: dict) -> list[dict]:
    """The chain of runs, first to last: each --init-from run records its predecessor under init_from (and
    that one's under prior)."""
    chain, m = [meta], meta.get("init_from")
    while m:
        chain.append(m)
        m = m.get("prior") or m.get("init_from")
    return chain[::-1]


RUN_NOTES = (  # what each run of the shipped model did differently (see its training.json for the rest)
    "from scratch; one core of an AMD EPYC (Zen 4, AVX512_BF16) under SCHED_RR, bf16 autocast; lr 1.5e-3 after "
    "100 warm-up steps, decayed to 10 % over the last 400 K tokens; 65 % of windows carry a task",
    "from run 1's end state (AdamW moments included); one core of an AMD EPYC (Zen 3, AVX2: fp32 matmuls, bf16 "
    "is ~100x slower there) under SCHED_RR; lr 1e-3 after 40 warm-up steps; 80 % of windows carry a task and the "
    "loss weighs tokens only the context can give (queried values, repeated segments) 4x, answers tokenized as "
    "the task suite splits them (` 48213`); stopped in its 4,096 phase (retrieval had not formed at 1.1 M tokens; "
    "a 1,024-token window carries 4x the tasks per token)",
    "from run 2's last state; same machine and loss; 1,024-token windows only, lr 1e-3 decayed to 10 % over the "
    "last 500 K tokens",
    "from run 3's shipped weights (AdamW moments fresh); same machine and loss; the retrieval-dense mix "
    "(`--mix dense`: every fact of a key -> value window queried, ~2x the answers per token, 95 % of windows carry "
    "a task) from 512 tokens up; lr 1e-3 after 40 warm-up steps, decayed to 10 % over the last 700 K tokens; "
    "stopped once at the end of its first phase and resumed with the longer plan shown (the first phase's "
    "schedule is the same under both plans; the resume is bit-exact)",
)


def training_lines(meta: dict, cpu: str, peak: float, c: dict) -> list[str]:
    chain = runs(meta)
    total = sum(r["tokens"] for r in chain)
    secs = sum(r["train_seconds"] for r in chain)
    lines = [
        f"{total:,} tokens in all, {secs / 3600:.2f} CPU-hours (one core at a time), in {len(chain)} runs:",
        "",
    ]
    for i, r in enumerate(chain):
        note = RUN_NOTES[i] if i < len(RUN_NOTES) else ""
        lines.append(
            f"{i + 1}. `{r.get('phases', '?')}` (sequence x batch: tokens): {r['tokens']:,} tokens, "
            f"{r['train_seconds'] / 60:.0f} min; {note}."
        )
    lines += [
        "",
        "All runs: AdamW (0.9, 0.95), MTP loss weight 0.3, DeepSeek-V3's auxiliary-loss-free routing bias plus a",
        "sequence-wise balance loss (0.01), fp32 master weights, torch.compile, one thread.",
        f"The last run's throughput on {cpu}, MFU against {peak:.0f} GFLOP/s (1024^3 matmul in its dtype, one thread):",
        "",
        "| sequence | tokens/s | MFLOP/token | MFU |",
        "|---|---|---|---|",
        *phase_rows(meta, c, peak),
    ]
    return lines


def goal_lines(ev: dict, top: str) -> list[str]:
    """Each target of the model's specification, met or not, with the measured figure."""
    out = []
    for kind in ("code", "prose"):
        t, lp = ev[kind]["tasks"], ev[kind]["loss_by_position"]
        needle = min(t["needle"][top]["by_depth"].values())
        far = [v for k, v in lp.items() if int(k.split("-")[0]) >= 1024]
        checks = [
            (f"needle >= 95 % at every depth at {top}", needle >= 0.95, f"lowest depth {needle:.0%}"),
            (f"multikey (16 pairs) >= 90 % at {top}", t["multikey"][top]["accuracy"] >= 0.9,
             f"{t['multikey'][top]['accuracy']:.0%}"),
            ("copy of 256 tokens >= 95 % token accuracy", t["copy"][top]["token_accuracy"] >= 0.95,
             f"{t['copy'][top]['token_accuracy']:.1%}"),
            ("loss at 1K-4K below loss at 256-512", all(v < lp["256-512"] for v in far),
             f"{lp['256-512']:.3f} vs " + " / ".join(f"{v:.3f}" for v in far)),
        ]  # fmt: skip
        out += [f"- {kind}: {name}: **{'met' if ok else 'NOT met'}** ({fig})" for name, ok, fig in checks]
    n = ev["samples"]
    out.append(
        f"- 'met' is the measured point estimate. Task figures are from n = {n} samples per cell (needle: "
        f"{n // 5} per depth), so the Wilson intervals above are wide: a 100 % cell cannot exclude a true rate "
        "below 95 % at this n."
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", type=Path, default=REPO / "src/mlaq/assets/mlaq-tiny-4k")
    p.add_argument("--eval", type=Path, required=True, help="scripts/tiny4k_eval.py's JSON")
    p.add_argument("--peak-gflops", type=float, default=0.0, help="bf16 matmul GFLOP/s of one thread")
    p.add_argument("--cpu", default="an AMD EPYC (Zen 3: AVX2, no AVX-512), 2 vCPUs")
    a = p.parse_args()
    c = json.loads((a.model / "config.json").read_text())
    meta = json.loads((a.model / "training.json").read_text())
    ev = json.loads(a.eval.read_text())
    bf16 = meta.get("autocast", "bf16") == "bf16"
    peak = a.peak_gflops or measure_peak(torch.bfloat16 if bf16 else torch.float32)
    with safe_open(str(a.model / "model.safetensors"), "pt") as f:
        params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
    size_mib = (a.model / "model.safetensors").stat().st_size / 2**20
    lines = [
        "# mlaq-tiny-4k",
        "",
        "mlaq's bundled model: a small DeepSeek-V3 (`model_type: deepseek_v3`) with DeepSeek-V3's real per-head",
        "MLA latent geometry and a 4,096-token context it actually uses, trained from scratch on CPU by",
        "`scripts/train_ctx.py`. It exists so that `mlaq validate` can show what re-quantizing the absorbed",
        "BMMs does to long-context retrieval on a model that retrieves; it is not a general-purpose LM.",
        "",
        "## Architecture",
        "",
        "| | |",
        "|---|---|",
        f"| MLA | {c['num_attention_heads']} heads, kv_lora_rank {c['kv_lora_rank']}, q_lora_rank {c['q_lora_rank']}, "
        f"qk_nope {c['qk_nope_head_dim']}, qk_rope {c['qk_rope_head_dim']}, v {c['v_head_dim']} (DeepSeek-V3's; "
        f"kv_lora_rank + rope = {c['kv_lora_rank'] + c['qk_rope_head_dim']}, what vLLM's MLA backends need) |",
        f"| layers | {c['num_hidden_layers']} (first {c['first_k_dense_replace']} dense) + "
        f"{c['num_nextn_predict_layers']} MTP layer, hidden {c['hidden_size']} |",
        f"| MoE | {c['n_routed_experts']} routed experts (top-{c['num_experts_per_tok']}, sigmoid, noaux_tc, "
        f"{c['n_group']} groups / top-{c['topk_group']}) + {c['n_shared_experts']} shared, intermediate "
        f"{c['moe_intermediate_size']} |",
        f"| context | {c['max_position_embeddings']} tokens, RoPE theta "
        f"{c.get('rope_parameters', {}).get('rope_theta', 10000):g}, interleaved, no YaRN (trained at 4,096 directly) |",
        f"| vocabulary | {c['vocab_size']} (byte-level BPE on code + prose), untied embeddings |",
        f"| size | {params / 1e6:.1f} M parameters, {size_mib:.1f} MiB in bf16 |",
        "",
        "## Data",
        "",
        f"- Code: this Python's standard library source including its test suite, minus the held-out modules "
        f"(csv, html, http, json, textwrap, tomllib and their tests): {meta['info']['train_tokens']['code']:,} tokens.",
        f"- Prose: the Linux kernel's Documentation (Debian `linux-doc`), first 30 MB in path order: "
        f"{meta['info']['train_tokens']['prose']:,} tokens.",
        "- Windows take natural text from one source (uniformly) and embed a retrieval task in it",
        "  (`scripts/ctx_data.py`): 1-64 key -> value facts in one of 7 surface forms (code assignment, dict",
        "  entry, YAML, prose ...) queried at the end in 1-3 forms each; a segment repeated verbatim or a",
        "  quoted string of random words asserted later; assignment chains ending in an `assert`. Keys and",
        "  values are fresh random pseudo-words and numbers in every window.",
        "- Held out, never trained on: `heldout.txt` (source of the held-out stdlib modules) and",
        "  `heldout-prose.txt` (the Python tutorial and FAQ from Debian `python3.11-doc`: prose of another",
        "  source and author). The evaluation tasks (mlaq.validate.tasks) draw fresh keys and values; their",
        '  surface forms (`k = v`, `table["k"] = v`, `assert k == v`) are among the training forms.',
        "",
        "## Training",
        "",
        *training_lines(meta, a.cpu, peak, c),
        "",
        "Replay (any Linux with Python 3.11; the data come from Debian packages):",
        "```bash",
        "apt-get install linux-doc python3.11-doc",
        "git show 9e0406c94222a5190dd0e9ffc819e267505d1564:scripts/state/mlaq-tiny-4k.safetensors > run1.safetensors   # run 1's end state (bf16 weights + AdamW moments, 87.5 MB)",
        "chrt -r 10 .venv/bin/python scripts/train_ctx.py --run tiny4k-v1   # run 1 (resumable)",
        "chrt -r 10 .venv/bin/python scripts/train_ctx.py --run tiny4k-v2 --init-from run1.safetensors \\",
        "    --phases 1024x4:400000,2048x2:700000,4096x1:800000 --lr 1e-3 --warmup 40 --decay-tokens 800000",
        "    # run 2 was stopped; its 5-minute state at 1,187,840 tokens is where run 3 starts",
        "chrt -r 10 .venv/bin/python scripts/train_ctx.py --run tiny4k-v3 --init-from ~/.cache/mlaq-train/tiny4k-v2/state.safetensors \\",
        "    --phases 1024x4:1400000 --lr 1e-3 --warmup 10 --decay-tokens 500000 --seed 7   # run 3",
        "git worktree add /tmp/run3 383d2a1   # run 3's weights, as shipped before run 4",
        "chrt -r 10 .venv/bin/python scripts/train_ctx.py --run tiny4k-v4 --init-from /tmp/run3/src/mlaq/assets/mlaq-tiny-4k \\",
        f"    --mix dense --phases {meta['phases']} --lr 1e-3 --warmup 40 --decay-tokens 700000 --seed 11   # run 4",
        "```",
        "All runs are resumable (state every 5 minutes under ~/.cache/mlaq-train/RUN). To continue from the",
        "shipped weights on a fresh machine: `--init-from src/mlaq/assets/mlaq-tiny-4k` (weights; AdamW moments",
        "start fresh). No optimizer state is in the tree: run 1's end state is kept in git history (commit",
        "9e0406c94222a5190dd0e9ffc819e267505d1564, see the replay above); later states (87 MB each) were never committed.",
        "",
        "## Held-out figures (bf16, mlaq's engine)",
        "",
        f"`python scripts/tiny4k_eval.py --samples {ev['samples']}` ({ev['seconds']:.0f} s). Loss (nats/token) by position",
        "on plain held-out text, windows of the full context:",
        "",
    ]
    for kind in ("code", "prose"):
        lp = ev[kind]["loss_by_position"]
        if kind == "code":
            lines += ["| haystack | " + " | ".join(lp) + " |", "|---" * (len(lp) + 1) + "|"]
        lines.append(
            f"| {kind} ({ev[kind]['haystack']}) | " + " | ".join(f"{v:.3f}" for v in lp.values()) + " |"
        )
    lines += ["", "Task suite (accuracy, Wilson 95 % interval, n samples per cell):", ""]
    lens = [str(n) for n in ev["lengths"]]
    lines += ["| haystack | task | " + " | ".join(lens) + " |", "|---|---" + "|---" * len(lens) + "|"]
    for kind in ("code", "prose"):
        for task, per in ev[kind]["tasks"].items():
            cells = []
            for n in lens:
                e = per[n]
                cell = f"{e['accuracy']:.0%} [{e['ci'][0]:.0%}, {e['ci'][1]:.0%}] n={e['n']}"
                if task == "copy":
                    cell += f", tokens {e['token_accuracy']:.1%}"
                cells.append(cell)
            name = {"multikey": "multikey (16 pairs)", "copy": "copy (256 tokens)"}.get(task, task)
            lines.append(f"| {kind} | {name} | " + " | ".join(cells) + " |")
    lines += ["", "Needle accuracy by depth at the longest length:", ""]
    top = lens[-1]
    depths = list(ev["code"]["tasks"]["needle"][top]["by_depth"])
    lines += ["| haystack | " + " | ".join(depths) + " |", "|---" * (len(depths) + 1) + "|"]
    for kind in ("code", "prose"):
        bd = ev[kind]["tasks"]["needle"][top]["by_depth"]
        lines.append(f"| {kind} | " + " | ".join(f"{bd[d]:.0%}" for d in depths) + " |")
    lines += ["", "## Goals (on both held-out haystacks, at the longest length)", "", *goal_lines(ev, top)]
    (a.model / "README.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {a.model / 'README.md'}")


if __name__ == "__main__":
    main()

"""Render mlaq-tiny's model card (README.md) from the training record and the evaluation output.

    .venv/bin/python scripts/tiny_card.py --run build/tiny-runs/run_info.json \
        --eval build/tiny-runs/eval.json --machine "$(lscpu | grep 'Model name')"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _table(rows: list[list[str]], head: list[str]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _stage(run: dict, n: int, total: int) -> str:
    """One training run as markdown bullets, with the command that replays its schedule and data order."""
    a = run["args"]
    steps = run["steps_done"]
    decay = a["decay_start"] if a["decay_start"] not in (None, "None") else steps
    init = a.get("init_from")
    init = None if init in (None, "None") else init
    repeat = float(a.get("repeat_frac") or 0)
    seq = int(a["seq"])
    lo = int(a.get("repeat_min") or 0) or seq // 8
    hi = int(a.get("repeat_max") or 0) or seq // 2
    cmd = (
        f"python scripts/train_tiny.py --steps {steps} --decay-start {decay} --batch {a['batch']} "
        f"--seq {seq} --warmup {a['warmup']} --lr {a['lr']} --seed {a['seed']}"
        + (f" --init-from <stage {n - 1} checkpoint>" if init else "")
        + (f" --repeat-frac {a['repeat_frac']} --repeat-min {lo} --repeat-max {hi}" if repeat else "")
    )
    last = run["history"][-20:]
    main = sum(r["main"] for r in last) / len(last)
    mtp = sum(r["mtp"] for r in last) / len(last)
    start = f"continues from stage {n - 1}'s checkpoint with fresh AdamW state" if init else "from scratch"
    copy = (
        f"; {100 * repeat:.0f} % of its windows are a copy task (one natural segment of {lo}-{hi} tokens "
        f"repeated cyclically to {seq} tokens, so that attention learns early to find and copy earlier "
        "context; the held-out text has no such repeats)"
        if repeat
        else ""
    )
    lr = (
        f"lr {a['lr']}, {a['warmup']} warmup steps, constant, then linear decay to {a['min_lr_ratio']} x from "
        f"step {decay}"
        if decay != steps
        else f"lr {a['lr']}, {a['warmup']} warmup steps, then constant"
    )
    name = f"Stage {n} of {total}" if total > 1 else "Run"
    tok_s = run["history"][-1].get("tok_s")
    return (
        f"- {name} ({start}{copy}): {steps} steps of {a['batch']} x {seq}-token windows drawn uniformly "
        f"from the token stream ({steps * int(a['batch']) * seq:,} tokens, "
        f"{steps * int(a['batch']) * seq / run['train_tokens']:.1f} epochs), {lr}; "
        f"{run['train_minutes']} min ({tok_s:,} tokens/s). Training loss over its last 20 steps: main {main:.3f}, "
        f"MTP {mtp:.3f} nats/token. Replay (same schedule and data order): `{cmd}`"
    )


def _context_tables(ev: dict) -> str:
    """The two same-token context measurements of scripts/tiny_eval.py, when present."""
    out = []
    if "context_curve" in ev:
        rows = [
            [str(r["context"]), f"{r['loss']:.3f}", f"{100 * r['mtp_acceptance']:.1f} %", str(r["tokens"])]
            for r in ev["context_curve"]
        ]
        out.append(
            "Same tokens, more context (the last 512 tokens of evenly spread 2048-token windows, scored when "
            "the model sees only c tokens before them; content is fixed, only the context grows):\n\n"
            + _table(rows, ["context c", "loss (nats/token)", "MTP acceptance", "tokens"])
        )
    if "copy_test" in ev:
        rows = [[str(r["gap"]), f"{r['first']:.3f}", f"{r['second']:.3f}"] for r in ev["copy_test"]]
        out.append(
            "In-context copying (a 128-token held-out segment, `gap` tokens of other held-out text, the same "
            "segment again; mean loss over 6 segments):\n\n"
            + _table(rows, ["gap", "loss, first occurrence", "loss, second occurrence"])
        )
    return "\n\n".join(out)


def render(
    run: dict, ev: dict, cfg: dict, machine: str, notes: str, earlier: list[dict], conditions: str
) -> str:
    h, a = ev["heldout"], run["args"]
    pos_rows = [
        [k, f"{v['loss']:.3f}", f"{100 * v['mtp_acceptance']:.1f} %", str(v["tokens"])]
        for k, v in h["by_position"].items()
    ]
    geo = ", ".join(
        f"{k}={cfg[k]}"
        for k in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size",
            "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
            "n_shared_experts", "first_k_dense_replace", "routed_scaling_factor", "num_nextn_predict_layers",
            "max_position_embeddings",
        )
    )  # fmt: skip
    samples = "\n\n".join(
        f"Prompt (held-out token offset {s['offset']}, last 40 tokens shown):\n```\n{s['prompt_tail']}\n```\n"
        f"Greedy completion (48 tokens):\n```\n{s['completion']}\n```\n"
        f"Actual continuation:\n```\n{s['truth']}\n```"
        for s in ev["samples"]
    )
    p, par = run["params"], ev["parity"]
    curve = _context_tables(ev)
    runs = [*earlier, run]
    stages = "\n".join(_stage(r, i + 1, len(runs)) for i, r in enumerate(runs))
    total_min = round(sum(float(r["train_minutes"]) for r in runs), 1)
    with_tests = a.get("no_tests") in (None, "False", False)
    tests = ", the test suite `test/` included" if with_tests else ", `test/` excluded"
    return f"""# mlaq-tiny

A small model with DeepSeek-V3's architecture (`model_type: deepseek_v3`; MLA, sigmoid-routed MoE with a
shared expert and `noaux_tc` correction bias, one MTP layer), trained from scratch on CPU on Python
standard-library source so that mlaq has a real MLA checkpoint to measure out of the box. It is a test
article, not a useful language model.

## Architecture
{geo}; `rope_interleave: true`, `scoring_func: sigmoid`, `topk_method: noaux_tc`, untied embeddings.
Layer 0 is dense, layers 1..{cfg["num_hidden_layers"] - 1} are MoE. Parameters: {p["total"]:,} in all
({p["main"]:,} main model, of which {p["embeddings_and_lm_head"]:,} embeddings + lm_head; {p["mtp"]:,} MTP layer).
Weights are bf16 (`e_score_correction_bias` fp32, as in DeepSeek-V3's checkpoints).

**MTP layer** = `model.layers.{cfg["num_hidden_layers"]}.*` (Hugging Face names, DeepSeek-V3 layout):
`h' = eh_proj(concat(enorm(embed(x[t+1])), hnorm(h[t])))` (embedding half first), then one full decoder
layer (MLA + MoE, causal, RoPE position t), then `shared_head.norm` and the main `lm_head`; it predicts
x[t+2] at position t. `h[t]` is the main model's final hidden state AFTER the final norm `model.norm`
(what vLLM passes to its MTP layer as `previous_hidden_states`). `embed_tokens` and `shared_head.head` are
not stored for the MTP layer: the main model's embedding and lm_head are used. transformers'
`DeepseekV3ForCausalLM.from_pretrained` loads the main model and reports the MTP keys as unexpected.

## Training
- Corpus: the `.py` files of CPython {run["python"]}'s standard library ({run["train_files"]} files,
  {run["train_bytes"]:,} bytes, {run["train_tokens"]:,} tokens){tests}, excluding `encodings/` and
  `pydoc_data/`; each file is preceded by a line `# file: <relative path>`. Held out (never trained on,
  tokenizer included): top-level packages/modules {", ".join(run["heldout_names"])}, concatenated in
  sorted path order into `heldout.txt` ({run["heldout_bytes"]:,} bytes), and the test-suite files about
  them (`test/test_json/`, `test/test_httplib.py`, ...: any `test/` path naming a held-out module).
- Tokenizer: byte-level BPE (`tokenizers`), vocabulary {cfg["vocab_size"]} incl. `<|bos|>`, `<|eos|>`,
  `<|pad|>` (ids 0-2); no BOS is added to text.
- Objective: next-token cross-entropy + {a["mtp_weight"]} x MTP next-next-token cross-entropy (joint, as
  in DeepSeek-V3). Routers: DeepSeek-V3's auxiliary-loss-free balancing, bias speed
  gamma={a["bias_speed"]} per step (DeepSeek-V3: 1e-3 over far more steps), plus DeepSeek-V3's
  complementary sequence-wise balance loss with alpha={a.get("balance_alpha")} (DeepSeek-V3: 1e-4).
  AdamW (0.9, 0.95), weight decay 0.1 on matrices, grad-norm clip 1.0; fp32 master weights and optimizer
  state, matmuls under bf16 autocast (AMX), windows in an order fixed by the seed.
- Trained with `scripts/tiny_lean.py`, a lean module computing transformers' DeepSeek-V3 (stacked routed
  experts dispatched by one sort, CPU flash attention, `torch.compile`); its exported checkpoint gives
  transformers' logits (tests/test_tiny_lean.py and the loading check below).
{stages}
- Wall time on {machine} ({conditions}), torch {run["torch"]}:
  {total_min} min of training in all.

## Held-out evaluation (`python scripts/tiny_eval.py`)
`heldout.txt`: {ev["text_tokens"]:,} tokens in {h["windows"]} windows of up to 2048 tokens (teacher forced).
- Loss {h["loss"]:.3f} nats/token = **{h["bits_per_byte"]:.3f} bits per byte** (total nats / ln 2 /
  {h["bytes"]:,} bytes of the predicted tokens); top-1 accuracy {100 * h["main_top1"]:.1f} %.
- MTP: loss {h["mtp_loss"]:.3f}, top-1 accuracy of x[t+2] {100 * h["mtp_top1"]:.1f} %;
  **greedy acceptance (k=1) {100 * h["mtp_acceptance"]:.1f} %** = share of positions t where the MTP
  head's argmax (given the true x[t+1]) equals the main model's greedy prediction at t+1.

Loss and MTP acceptance by context position (position within the 2048-token window):

{_table(pos_rows, ["positions", "loss (nats/token)", "MTP acceptance", "tokens"])}

{curve}

Routed-expert load on the held-out text (share of routed slots per expert; uniform = {1 / cfg["n_routed_experts"]:.3f}):

{_table([[f"{i + 1}" if i + 1 < cfg["num_hidden_layers"] else "MTP", " ".join(f"{x:.3f}" for x in row)] for i, row in enumerate(h["expert_load"])], ["MoE layer", "expert shares"])}

Loading check (fp32): transformers (`DeepseekV3ForCausalLM.from_pretrained`, its decoder layer as the MTP
layer) vs the training module holding the same weights: max |logit difference| {par["main_logits_max_abs_diff"]:.2e} (main),
{par["mtp_logits_max_abs_diff"]:.2e} (MTP) at logit scale {par["logit_scale"]:.1f}.
Evaluation took {ev["eval_seconds"]} s.

## Samples (greedy, held-out prompts of 256 tokens)
{samples}
{notes}"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, default=Path("build/tiny-runs/run_info.json"))
    p.add_argument("--eval", type=Path, default=Path("build/tiny-runs/eval.json"))
    p.add_argument("--model", type=Path, default=REPO / "src/mlaq/assets/mlaq-tiny")
    p.add_argument(
        "--earlier", type=Path, nargs="*", default=[], help="run_info.json of earlier stages, in order"
    )
    p.add_argument("--machine", default="unknown CPU")
    p.add_argument("--notes", default="", help="extra markdown appended to the card")
    p.add_argument("--conditions", default="2 cores", help="what else ran on the machine meanwhile")
    a = p.parse_args()
    run, ev = json.loads(a.run.read_text()), json.loads(a.eval.read_text())
    cfg = json.loads((a.model / "config.json").read_text())
    earlier = [json.loads(x.read_text()) for x in a.earlier]
    (a.model / "README.md").write_text(
        render(run, ev, cfg, a.machine.split(":", 1)[-1].strip(), a.notes, earlier, a.conditions)
    )


if __name__ == "__main__":
    main()

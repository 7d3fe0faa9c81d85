"""Decode throughput: mlaq's engine (plain and MTP k = 1..3) vs transformers ``generate``, one run.

    .venv/bin/python bench/decode.py                  # bundled mlaq-tiny-4k if present, else a random tiny checkpoint
    .venv/bin/python bench/decode.py --model DIR --batches 1 4 16 --new-tokens 64
    .venv/bin/python bench/decode.py --threads 1 --compile   # + mlaq with compile=True
    .venv/bin/python bench/decode.py --threads 1 --compile --dtype bfloat16 --batches 1

With --compile, a second table gives ``LLM(..., compile=True)`` (torch.compile'd decode / MTP steps,
weights frozen into the graphs) at every batch, with MTP only at --compile-spec-batches (default 1).
Its warm-up covers every shape of the timed run (it is the same run), so compilation is excluded
from tok/s and reported separately (warm-up time minus timed time). Graphs are reused across LLM
instances of one process where guards allow (same code, shapes already seen), so later rows may
show little or no compile time.

Tokens/s = generated tokens / wall time of the whole generate call (prefill included; the fastest of
--repeats runs), greedy, ignore_eos, on CPU, one thread set by --threads; --dtype (float32 by
default, or the checkpoint's bfloat16) for both engines. Ratios are mlaq / transformers at equal
batch. Speculative rows also give vLLM's mean acceptance length. ``bench/roofline.py`` gives the
batch-1 floor these numbers are bounded by (weight bytes per token / read bandwidth).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
BUNDLED = REPO / "src/mlaq/assets/mlaq-tiny-4k"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

from mlaq.engine.llm import LLM  # noqa: E402
from mlaq.engine.sampling_params import SamplingParams  # noqa: E402


def random_checkpoint(path: Path) -> Path:
    """A random DeepSeek-V3 checkpoint with an MTP layer (the test helpers' builder, small dims)."""
    sys.path.insert(0, str(REPO / "tests"))
    from model_helpers import add_mtp_layer, hf_checkpoint

    model, _ = hf_checkpoint(
        "deepseek_v3", path, num_hidden_layers=4, hidden_size=256, vocab_size=2048, intermediate_size=512,
        moe_intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=128,
    )  # fmt: skip
    add_mtp_layer(model, path)
    return path


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


def bench_mlaq(
    path: Path, batch: int, args: argparse.Namespace, k: int, compile: bool = False
) -> tuple[float, str, float]:
    """(tokens/s, acceptance note, warm-up seconds: the compile time with ``compile``)."""
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    llm = LLM(
        path,
        dtype=args.torch_dtype,  # as transformers below, whatever the checkpoint stores
        max_model_len=args.prompt_len + args.new_tokens + 8,
        max_num_seqs=batch,
        speculative_config=spec,
        compile=compile,
    )
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    ps = [{"prompt_token_ids": p} for p in prompts(batch, args.prompt_len, llm.engine.model.vocab_size)]
    # warm-up; compiled: the very run that is timed, so every shape it meets is compiled before
    start = time.perf_counter()
    llm.generate(
        ps if compile else ps[:1],
        params if compile else SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
    )
    warm_s = time.perf_counter() - start
    elapsed = float("inf")
    for _ in range(args.repeats):  # best of: the machine may be shared
        start = time.perf_counter()
        outs = llm.generate(ps, params)
        elapsed = min(elapsed, time.perf_counter() - start)
    warm_s -= elapsed if compile else 0.0  # compiled: the warm-up's extra time, i.e. compilation
    stats = llm.spec_decoding_stats
    note = ""
    if stats is not None and stats.num_drafts:
        note = f"mean acceptance length {stats.mean_acceptance_length:.2f}"
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed, note, warm_s


def bench_transformers(path: Path, batch: int, args: argparse.Namespace) -> float:
    import transformers

    transformers.logging.set_verbosity_error()  # the MTP tensors it does not know are expected
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=args.torch_dtype).eval()
    ids = torch.tensor(prompts(batch, args.prompt_len, model.config.vocab_size))
    kw = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens, "do_sample": False}
    with torch.no_grad():
        model.generate(ids[:1], max_new_tokens=2, do_sample=False)  # warm-up
        elapsed = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            elapsed = min(elapsed, time.perf_counter() - start)
    return (out.shape[1] - ids.shape[1]) * batch / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--spec", type=int, nargs="+", default=[1, 2, 3], help="MTP num_speculative_tokens values")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--repeats", type=int, default=3, help="timed runs per cell; the fastest counts")
    p.add_argument("--compile", action="store_true", help="also mlaq with compile=True (second table)")
    p.add_argument("--compile-spec-batches", type=int, nargs="*", default=[1])
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default="float32", help="weights and activations, both engines"
    )
    args = p.parse_args()
    args.torch_dtype = DTYPES[args.dtype]
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or (
            BUNDLED if (BUNDLED / "config.json").is_file() else random_checkpoint(Path(tmp))
        )
        print(f"model: {path if path != Path(tmp) else 'random tiny DeepSeek-V3 + MTP'}")
        print(
            f"machine: {cpu_name()} ({os.cpu_count()} cores), {args.threads} thread(s), torch {torch.__version__}"
        )
        print(
            f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens per request, greedy, {args.dtype}, "
            f"best of {args.repeats} runs\n"
        )
        print(
            "| batch | transformers tok/s | mlaq tok/s | ratio | "
            + " | ".join(f"mlaq MTP k={k} tok/s (ratio; accept len)" for k in args.spec)
            + " |"
        )
        print("|" + "---|" * (4 + len(args.spec)))
        compiled_rows = []
        for batch in args.batches:
            hf = bench_transformers(path, batch, args)
            plain, _, _ = bench_mlaq(path, batch, args, 0)
            cells = [f"{batch}", f"{hf:.1f}", f"{plain:.1f}", f"{plain / hf:.2f}x"]
            for k in args.spec:
                tps, note, _ = bench_mlaq(path, batch, args, k)
                cells.append(f"{tps:.1f} ({tps / hf:.2f}x; {note.split()[-1] if note else '-'})")
            print("| " + " | ".join(cells) + " |", flush=True)
            if args.compile:
                compiled_rows.append(compiled_row(path, batch, args, hf, plain))
        if args.compile:
            print("\nmlaq compile=True (ratios vs transformers; compile = warm-up seconds, not in tok/s)\n")
            print(
                "| batch | mlaq compiled tok/s | vs transformers | vs mlaq eager | compile s | "
                + " | ".join(f"compiled MTP k={k} tok/s (ratio; compile s)" for k in args.spec)
                + " |"
            )
            print("|" + "---|" * (5 + len(args.spec)))
            for row in compiled_rows:
                print(row)


def compiled_row(path: Path, batch: int, args: argparse.Namespace, hf: float, eager: float) -> str:
    tps, _, warm = bench_mlaq(path, batch, args, 0, compile=True)
    cells = [f"{batch}", f"{tps:.1f}", f"{tps / hf:.2f}x", f"{tps / eager:.2f}x", f"{warm:.0f}"]
    for k in args.spec:
        if batch in args.compile_spec_batches:
            spec, _, warm = bench_mlaq(path, batch, args, k, compile=True)
            cells.append(f"{spec:.1f} ({spec / hf:.2f}x; {warm:.0f})")
        else:
            cells.append("-")
    row = "| " + " | ".join(cells) + " |"
    print(f"compiled: {row}", flush=True)
    return row


if __name__ == "__main__":
    main()

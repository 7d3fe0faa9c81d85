"""The long-window evidence of docs/long-context.md in two parts that fit a small shared CPU, each a
fraction of the full `mlaq validate` run (which adds the per-layer attention replay, the per-op
figures and the fp32 noise floor, and runs the two parts one after the other).

    python bench/long_context.py teacher-forced MODEL --context-len 16384 --windows 1 --threads 2 --out DIR
    python bench/long_context.py generation MODEL --prompts 3 --prompt-len 8192 --max-tokens 256 \\
        --threads 2 --out DIR
    python bench/long_context_tables.py DIR/report.json     # teacher-forced tables
    python bench/long_context_tables.py DIR/generation.json # generation table

Both take `mlaq validate`'s options and draw the same windows and prompts as it does (same seed).
- ``teacher-forced``: validate's engine source on the bf16 reference and the schemes: per window the
  reference capture, each scheme's whole-window stream (KL, top-1, ΔNLL by position) and the attention
  flips on the sampled query rows; without the per-layer replay and the per-op figures (their fields
  are absent from report.json), and with the fp32 noise floor only when ``--floor`` is given.
  Generation is validate's own, so keep ``--prompts 1 --prompt-len 16 --max-tokens 8`` small there.
- ``generation``: greedy generation (MTP speculative, ``--num-speculative-tokens``) from the prompts
  under bf16 and each scheme, no teacher forcing; writes DIR/generation.json with report.json's
  generation fields (acceptance counters, the paired acceptance ratio interval, repeated n-grams).
Prints the wall time and the process's CPU seconds; run it under /usr/bin/time -v for the peak memory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from mlaq.cli import validate as validate_cli
from mlaq.libc import keep_freed_memory


@contextlib.contextmanager
def lean_teacher_forced() -> Iterator[None]:
    """Validate's windows without the per-layer replay and the per-op figures, while inside."""
    from mlaq.validate.sources import windows
    from mlaq.validate.variants import scheme_descriptions

    def per_op(pool, runs, reference, others, layers, ref_abs):
        for v in [reference, *others]:
            runs[v].descriptions = scheme_descriptions(pool.model(v))
        return {}

    lean = {
        "_per_op": per_op,
        "project_input": lambda model, inp: None,
        "attention_output": lambda model, inp, projected=None: None,
        "_add_layer_errors": lambda run, sums, layers, outputs: None,
    }
    saved = {name: getattr(windows, name) for name in lean}
    for name, fn in lean.items():
        setattr(windows, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(windows, name, fn)


def teacher_forced(args: argparse.Namespace, config) -> dict:
    from mlaq.validate.config import NOISE_FLOOR
    from mlaq.validate.report import write_report
    from mlaq.validate.runner import measure
    from mlaq.validate.stats import summarize

    with lean_teacher_forced():
        record = measure(config, noise_floor=NOISE_FLOOR if args.floor else None)
    report = summarize(record)
    write_report(report, args.out)
    return report


def generation(args: argparse.Namespace, config) -> dict:
    from mlaq.model.config import ModelConfig
    from mlaq.validate.config import REFERENCE
    from mlaq.validate.generation import generate
    from mlaq.validate.inputs import local_inputs
    from mlaq.validate.record import GenerationRecord, SpecCounts
    from mlaq.validate.stats import acceptance, acceptance_ratio_ci
    from mlaq.validate.stats import generation as generation_stats
    from mlaq.validate.variants import ModelPool

    model_config = ModelConfig.from_dir(config.model)
    context = config.resolve_context(model_config.max_position_embeddings)
    prompts = local_inputs(config, context, model_config.max_position_embeddings).data.prompts()
    pool, k, shape = ModelPool(config), config.num_speculative_tokens, config.shape
    out: dict = {
        "config": {**vars(args), "out": str(args.out), "model": str(config.model), "context_len": context}
    }
    out["config"].update(
        prompts=len(prompts), prompt_len=len(prompts[0]), num_speculative_tokens=k, ngram=shape.ngram
    )
    ref_record = None
    for v in [REFERENCE, *config.variants(REFERENCE)]:
        start = time.perf_counter()
        gen = generate(
            pool.model(v), prompts, max_tokens=shape.max_tokens, num_speculative_tokens=k,
            max_model_len=context, seed=shape.seed,
        )  # fmt: skip
        s = gen.stats
        spec = None if s is None else SpecCounts(
            s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, list(s.num_accepted_tokens_per_pos),
            None if gen.per_request is None else [list(x) for x in gen.per_request],
        )  # fmt: skip
        record = GenerationRecord([list(t) for t in gen.tokens], gen.seconds, spec)
        entry = {**acceptance(spec), "generation": generation_stats(record, ref_record, shape.ngram)}
        entry["seconds"] = time.perf_counter() - start
        if ref_record is None:
            ref_record, out["reference"], out["schemes"] = record, entry, {}
        else:
            entry["acceptance_ratio_ci"] = acceptance_ratio_ci(ref_record.spec, spec, shape.seed)
            out["schemes"][v.name] = entry
        print(f"{v.name}: {entry['seconds']:.0f} s, acceptance {entry['acceptance_rate']}", flush=True)
    out["noise_floor"] = None
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "generation.json").write_text(
        json.dumps(out, indent=2, default=str) + "\n", encoding="utf-8"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("teacher-forced", "generation"))
    validate_cli.add_arguments(parser)
    parser.add_argument("--floor", action="store_true", help="teacher-forced: also the fp32 noise floor")
    args = parser.parse_args(argv)
    if args.out is None:
        parser.error("--out DIR is required")
    config = validate_cli.config_from_args(args)
    keep_freed_memory()
    if args.threads:
        torch.set_num_threads(args.threads)
    w0, c0 = time.perf_counter(), time.process_time()
    (teacher_forced if args.part == "teacher-forced" else generation)(args, config)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    print(f"{args.part}: {wall:.0f} s wall, {cpu:.0f} CPU-s, {args.threads} thread(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

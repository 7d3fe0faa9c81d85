"""The run-shape options of ``mlaq validate``, shared by every source (the local engine, ``--stream``,
``--server``): the evaluation text, the windows and prompts, the long-context tasks, the seed.

``run_shape(args)`` builds the one ``RunShape`` a run measures with; each source's own options
(cli/validate.py, cli/validate_server.py) add only what that source needs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mlaq.validate import defaults as d

_SIZES = (
    (
        "--context-len",
        "context_len",
        None,
        f"teacher-forcing window length (default: the model's context, at most {d.MAX_DEFAULT_CONTEXT})",
    ),
    ("--windows", "windows", d.WINDOWS, "teacher-forced windows of --context-len tokens"),
    ("--buckets", "buckets", d.BUCKETS, "context-position buckets"),
    ("--prompts", "prompts", d.PROMPTS, "greedy generations from held-out prompts"),
    ("--prompt-len", "prompt_len", d.PROMPT_LEN, "prompt length in tokens"),
    ("--max-tokens", "max_tokens", d.MAX_TOKENS, "tokens generated per prompt"),
    ("--ngram", "ngram", d.NGRAM, "n of the repeated n-gram share"),
)
ALL_TASKS = "needle,multikey,copy,vartrack"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--eval-text",
        metavar="PATH",
        help="evaluation text (default: MODEL/heldout.txt, or the bundled model's with --server; the bundled "
        "mlaq-tiny-4k also ships heldout-prose.txt, English prose)",
    )
    for flag, dest, default, help_text in _SIZES:
        parser.add_argument(flag, dest=dest, type=int, default=default, metavar="N", help=help_text)


def add_task_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tasks",
        default=ALL_TASKS,
        metavar="LIST",
        help=f"long-context tasks, comma-separated (default {ALL_TASKS}; 'none': skip the suite)",
    )
    parser.add_argument(
        "--lengths",
        metavar="N,N,...",
        help="task lengths in tokens (default: the model's context, at most 4096)",
    )
    parser.add_argument(
        "--task-samples",
        metavar="N|TASK=N,...",
        help="long-context task samples per length: N for every task, or per task such as needle=64,copy=8 "
        f"(default {d.TASK_SAMPLES})",
    )
    parser.add_argument(
        "--needle-depths", metavar="D,D,...", help="needle depths in [0, 1] (default 0,0.25,0.5,0.75,1)"
    )


def run_shape(args: argparse.Namespace, eval_text: Path | None = None, tasks: bool = True):  # -> RunShape
    """The run's shape from its arguments; ``eval_text``: the text when --eval-text is not given (a local
    checkpoint's held-out file); ``tasks=False``: no task suite whatever --tasks says."""
    from mlaq.validate.shape import RunShape

    return RunShape(
        eval_text=Path(args.eval_text) if args.eval_text else eval_text,
        context_len=args.context_len,
        windows=args.windows,
        buckets=args.buckets,
        prompts=args.prompts,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        ngram=args.ngram,
        seed=args.seed,
        tasks=task_config(args) if tasks else None,
    )


def task_config(args: argparse.Namespace):  # -> TaskConfig | None
    from mlaq.validate.tasks import spec

    depths = spec.parse_depths(args.needle_depths) if args.needle_depths is not None else spec.DEFAULT_DEPTHS
    lengths = spec.parse_ints("--lengths", args.lengths) if args.lengths is not None else None
    if args.tasks.strip() == "none":
        return None
    samples, per_task = spec.parse_samples(args.task_samples or d.TASK_SAMPLES)
    tasks = spec.parse_tasks(args.tasks)
    return spec.TaskConfig(tasks, lengths, samples, per_task, depths=depths, seed=args.seed)

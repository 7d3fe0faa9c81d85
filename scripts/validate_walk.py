"""Follow the parameters of a small ``mlaq validate`` run through the code, and count the returns.

A *stop* is a call of a function in mlaq's sources that receives one of the run's parameters or what
they became: the parsed arguments, the configurations (validate's, the task suite's, the verdict's, a
variant), the measurement record (or one variant's record, the task suite's), the report or one
variant's figures in it. The walk is the sequence of files of the stops, a file repeated back to back counted
once; a *return* is a stop in a file the walk had already left. Few returns: the parameters flow down
through the layers (arguments -> configuration -> source -> record -> statistics -> report -> renderers)
instead of going back and forth between the same files.

    python scripts/validate_walk.py            # the bundled model, a tiny run (a few seconds)
    python scripts/validate_walk.py --list     # and every stop: file, function

Uses ``sys.settrace`` on calls only (no line events); prints stops, files and returns.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

SMALL_RUN = [
    "validate",
    "--schemes",
    "fp8_per_tensor",
    "--windows",
    "1",
    "--context-len",
    "64",
    "--prompts",
    "1",
    "--prompt-len",
    "16",
    "--max-tokens",
    "4",
    "--flip-rows",
    "2",
    "--tasks",
    "none",
    "--no-progress",
    "--out",
]


# a parameter's own field reads (a frozen report read as a mapping): reading, not a stop
FIELD_READS = frozenset({"__getitem__", "__iter__", "__len__", "__contains__", "__eq__"})


def parameter_types() -> tuple[type, ...]:
    """The types of the run's parameters (whatever the code calls them, wherever they live)."""
    import mlaq.validate.config as config
    import mlaq.validate.record as record
    import mlaq.validate.shape as shape
    import mlaq.validate.tasks.spec as spec
    import mlaq.validate.verdict as verdict

    kinds: list[type] = [
        argparse.Namespace,
        config.ValidateConfig,
        shape.RunShape,
        config.Variant,
        spec.TaskConfig,
    ]
    kinds += [verdict.VerdictConfig, record.Record, record.VariantRecord, record.TaskSuiteRecord]
    with contextlib.suppress(ImportError, AttributeError):
        import mlaq.validate.report_types as report_types  # the typed report, where there is one

        kinds.append(report_types.Report)
    return tuple(kinds)


def _is_parameter(value: object, kinds: tuple[type, ...]) -> bool:
    if isinstance(value, kinds):
        return True
    if not isinstance(value, Mapping):  # a dict, or a frozen report's read-only view
        return False
    return {"format_version", "schemes"} <= set(value) or {"name", "kind", "dtype"} <= set(value)


def walk(argv: list[str]) -> list[tuple[str, str]]:
    """(file relative to mlaq's sources, function) of every stop of ``mlaq <argv>``, in order."""
    import mlaq
    from mlaq.cli import main

    root = str(Path(mlaq.__file__).resolve().parent)
    kinds = parameter_types()
    stops: list[tuple[str, str]] = []

    def tracer(frame, event, arg):
        if event != "call":
            return None
        code = frame.f_code
        file = code.co_filename
        if not file.startswith(root) or code.co_name in FIELD_READS:
            return None
        n = code.co_argcount + code.co_kwonlyargcount
        args = [frame.f_locals.get(name) for name in code.co_varnames[:n]]
        if any(_is_parameter(a, kinds) for a in args):
            stops.append((file[len(root) + 1 :], code.co_name))
        return None

    sys.settrace(tracer)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            main(argv)
    finally:
        sys.settrace(None)
    return stops


def returns(stops: list[tuple[str, str]]) -> tuple[int, int]:
    """(files visited, returns to a file already left) of the walk."""
    seen: set[str] = set()
    back, last = 0, None
    for file, _ in stops:
        if file == last:
            continue
        back += file in seen
        seen.add(file)
        last = file
    return len(seen), back


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every stop")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        stops = walk([*SMALL_RUN, out])
    files, back = returns(stops)
    if args.list:
        for file, func in stops:
            print(f"{file}:{func}")
    print(f"mlaq {' '.join(SMALL_RUN)} DIR")
    print(f"stops {len(stops)}, files {files}, returns to a file already left {back}")


if __name__ == "__main__":
    main()

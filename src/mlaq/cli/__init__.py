"""The ``mlaq`` command line: a thin front door over the library.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
it is imported only when chosen, so ``mlaq --help`` stays fast and the core needs no extras.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from mlaq import __version__
from mlaq.settings import bound_onednn_caches

# name -> (module, one-line help). Modules are imported lazily.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "bench-bmm": ("mlaq.cli.bench_bmm", "time every BMM scheme and an absorbed decode step"),
    "explain": ("mlaq.cli.explain", "show which BMM scheme each MLA layer's kv_b_proj gets, and why"),
    "validate": ("mlaq.cli.validate", "measure what re-quantizing MLA's absorbed BMMs costs against bf16"),
    "compare": (
        "mlaq.cli.compare",
        "compare two validate reports' task outcomes on the same samples, paired",
    ),
    "generate": ("mlaq.cli.generate", "complete prompts (MTP speculative decoding, vLLM's metrics)"),
    "serve": ("mlaq.cli.serve", "an OpenAI-compatible server (vLLM's flags, wire format and metrics)"),
    "audit": ("mlaq.cli.audit", "rank layers by what re-quantizing kv_b_proj loses, reading only kv_b_proj"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlaq",
        description="Quantize Multi-head Latent Attention safely: emulate, decide, measure.",
    )
    parser.add_argument("--version", action="version", version=f"mlaq {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module_name)
        importlib.import_module(module_name).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)  # --help / --version print here
        if args.command is None:
            parser.print_help()
            return 0
    except BrokenPipeError:
        _silence_stdout()
        return 141
    module = importlib.import_module(args._module)
    bound_onednn_caches()  # before the command's first GEMM: oneDNN reads it once (mlaq.settings)
    try:
        return int(module.run(args) or 0)
    except (ValueError, FileNotFoundError) as exc:  # user errors: message, no traceback
        print(f"mlaq {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's 128 + SIGINT
        print(f"mlaq {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `mlaq explain | head`: the reader left; stop quietly, as SIGPIPE would
        _silence_stdout()
        return 141


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that Python's flush at exit does not fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())

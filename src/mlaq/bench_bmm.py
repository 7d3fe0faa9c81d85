"""``mlaq bench-bmm`` — placeholder until the BMM benchmark lands (see bench/bmm.py)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repeats")


def run(args: argparse.Namespace) -> int:
    raise ValueError("the BMM benchmark is not built yet")

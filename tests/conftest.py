"""Shared test helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import mlaq

SRC = Path(mlaq.__file__).resolve().parent.parent


def run_mlaq(
    *args: str, env: dict[str, str] | None = None, check: bool = False
) -> subprocess.CompletedProcess:
    """Run ``python -m mlaq ARGS`` against the mlaq under test (not whatever is installed)."""
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), full_env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "mlaq", *args], capture_output=True, text=True, env=full_env, check=check
    )


@pytest.fixture
def mlaq_cli():
    return run_mlaq


@pytest.fixture(autouse=True, scope="session")
def _torch_one_thread():
    """One intra-op thread: the CI machine's 2 cores are shared, and with 2 OpenMP threads competing
    for them every small torch op spin-waits (the BMM tests ran 8x slower: 49 s vs 6 s)."""
    import torch

    torch.set_num_threads(1)
    yield

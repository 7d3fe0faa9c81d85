"""The clone stands on its own: no tracked file points outside the repository (.ci/run checks the same)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATTERN = r"\.\./shared|/work/shared|shared/(fixtures|reference)/"


def _git_grep(pattern: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", "grep", "-n", "-I", "-E", pattern, "--", ".", ":!.ci", ":!tests/test_repo.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )


@pytest.fixture
def in_git() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")


def test_no_tracked_file_refers_outside_the_repository(in_git):
    found = _git_grep(PATTERN)
    assert found.returncode == 1, f"tracked files refer to ../shared:\n{found.stdout}"


def test_the_check_sees_a_reference(in_git):
    # the same pattern finds a known string in a tracked file (conftest.py): the check above can fail
    assert _git_grep(r"def run_mlaq").returncode == 0


def test_ci_runs_the_check_before_the_suite():
    text = (ROOT / ".ci" / "run").read_text()
    assert PATTERN in text
    assert text.index("git grep") < text.index("make test")

"""The user-facing documents hold their shape: a short README that starts with the two commands, links
that resolve, CI that runs the README's test command, and no text about how the project was built."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 250

# Build talk: work periods, internal issue numbers, numbered changes.
BUILD_TALK = re.compile(r"\bsessions?\b|\bissue #?[0-9]+|\bChange [0-9]+", re.IGNORECASE)
# Text a user reads: documents, code (docstrings, comments, --help), scripts and the bundled model cards.
# Not: tests, and the held-out evaluation texts (data drawn from other projects' documentation).
TEXT_SUFFIXES = {".md", ".py", ".c", ".h", ".toml", ".sh"}
USER_FACING_DIRS = ("docs", "src", "bench", "scripts")
LINKED_DOCS = ("README.md", "CHANGELOG.md", "bench/RESULTS.md")

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)


def tracked_files(folder: str) -> list[Path]:
    """The files git tracks under ``folder`` (build outputs and egg-info are not the project's text); every
    file there when this is not a git checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", folder], cwd=ROOT, capture_output=True, check=True)
        return [ROOT / name for name in out.stdout.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        return sorted(p for p in (ROOT / folder).rglob("*") if "__pycache__" not in p.parts)


def user_facing_files() -> list[Path]:
    files = [ROOT / name for name in ("README.md", "CHANGELOG.md", "Makefile", "pyproject.toml")]
    for folder in USER_FACING_DIRS:
        files += [p for p in tracked_files(folder) if p.suffix in TEXT_SUFFIXES]
    return [p for p in files if p.is_file()]


def markdown_with_links() -> list[Path]:
    return [ROOT / name for name in LINKED_DOCS if (ROOT / name).exists()] + sorted(
        (ROOT / "docs").glob("**/*.md")
    )


def readme_commands() -> list[str]:
    """The commands of the README's first code block (comments dropped)."""
    block = FENCE.search(README.read_text())
    assert block is not None, "README.md has no code block"
    lines = block.group(0).splitlines()[1:-1]
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(root)})")
    return broken


def test_readme_is_short() -> None:
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, (
        f"README.md has {n} lines; keep it <= {MAX_README_LINES} and move detail to docs/"
    )


def test_readme_starts_with_the_two_commands() -> None:
    head = README.read_text().split("```", 1)[0]
    assert len(head.splitlines()) <= 6, "the README's first code block must come right after its title"
    assert readme_commands() == ["make demo", "make test"], readme_commands()


def test_ci_runs_the_readmes_test_command() -> None:
    test_command = readme_commands()[1]
    # the command on a line of its own, possibly after environment assignments (VAR=value make test) or before a
    # comment
    runs = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*" + re.escape(test_command) + r"$")
    ci = [re.sub(r"\s+#.*$", "", line).strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    assert any(runs.match(line) for line in ci), (
        f".ci/run does not run the README's test command {test_command!r}"
    )


@pytest.mark.parametrize("path", markdown_with_links(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path) == [], f"{path.relative_to(ROOT)}: broken links"


def test_no_build_talk_in_user_facing_text() -> None:
    hits = []
    for path in user_facing_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if m := BUILD_TALK.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {m.group(0)!r}")
    assert hits == [], "user-facing text speaks of how the project was built:\n" + "\n".join(hits)


def test_the_link_checker_sees_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A `code` heading: here\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#a-code-heading-here) [gone](missing.md) [bad](there.md#nowhere)\n")
    assert broken_links(page, tmp_path) == [
        "missing.md (no such file)",
        "there.md#nowhere (no heading #nowhere in there.md)",
    ]

"""Nothing of the user's is replaced by surprise: ``--out`` replaces only report files mlaq wrote (its
manifest's hashes), ``--record`` only a recording; anything else is one line naming the file, exit 2,
the file unchanged, before anything is measured; ``--overwrite`` replaces it. ``--record``'s suffix picks
the format (.safetensors / .json, anything else refused); a truncated recording is one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import run_mlaq
from mlaq import outputs
from mlaq.validate.server.protocol import TeacherForced
from mlaq.validate.server.record import Recording, check_record_path, load_recording, save_recording

USER = '{"mine": "a user\'s own notes"}\n'


def _one_line_error(r, *words: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def test_prepare_out_refuses_a_file_mlaq_did_not_write(tmp_path: Path) -> None:
    (tmp_path / "report.json").write_text(USER)
    with pytest.raises(ValueError, match=r"report\.json exists and was not written by mlaq.*--overwrite"):
        outputs.prepare_out(tmp_path, ["report.json", "report.md"])
    assert (tmp_path / "report.json").read_text() == USER
    outputs.prepare_out(tmp_path, ["report.json"], overwrite=True)  # the user said so


def test_mlaqs_own_file_is_replaceable_until_the_user_edits_it(tmp_path: Path) -> None:
    (tmp_path / "report.md").write_text("# mlaq validate\n")
    outputs.note_written(tmp_path, ["report.md"])
    outputs.prepare_out(tmp_path, ["report.md"])  # mlaq's own: fine
    (tmp_path / "report.md").write_text("# mlaq validate\nmy notes\n")  # now it is the user's
    with pytest.raises(ValueError, match="not written by mlaq"):
        outputs.prepare_out(tmp_path, ["report.md"])


@pytest.mark.parametrize("command", [["validate"], ["audit"]])
def test_out_with_a_users_report_is_one_line_before_measuring(tmp_path: Path, command) -> None:
    (tmp_path / "report.json").write_text(USER)
    r = run_mlaq(*command, "--out", str(tmp_path), "--no-progress")
    _one_line_error(r, "report.json", "not written by mlaq", "--overwrite")
    assert (tmp_path / "report.json").read_text() == USER
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # nothing else written


@pytest.mark.parametrize("kind", ["file", "child-of-file"])
def test_audit_out_is_checked_before_the_audit(tmp_path: Path, kind) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    out = f if kind == "file" else f / "sub"
    r = run_mlaq("audit", "--out", str(out), "--no-progress")
    _one_line_error(r, "--out", str(out))
    assert f.read_text() == "x"


def test_audit_defaults_to_the_bundled_model_and_replaces_its_own_report(tmp_path: Path) -> None:
    args = ("audit", "--schemes", "fp8_per_tensor", "--out", str(tmp_path), "--no-progress")
    first = run_mlaq(*args)
    assert first.returncode == 0, first.stderr
    assert "mlaq-tiny-4k" in (tmp_path / "report.md").read_text()
    again = run_mlaq(*args)  # mlaq's own report: replaced, no --overwrite needed
    assert again.returncode == 0, again.stderr


def _recording() -> Recording:
    tf = TeacherForced((3, 4, 5), np.array([-1.0, -2.0]), ({4: -1.0, 7: -2.5}, {5: -2.0}))
    return Recording({"tokenizer": {"vocab_size": 8}}, (tf,), ((3, 4),), ((5, 6),))


@pytest.mark.parametrize("name", ["ref.txt", "ref", "ref.st", "ref.JSON.bak"])
def test_record_suffix_picks_the_format_or_is_refused(tmp_path: Path, name) -> None:
    with pytest.raises(ValueError, match=r"name it \.safetensors .* or \.json"):
        check_record_path(tmp_path / name)


@pytest.mark.parametrize("suffix", [".safetensors", ".json"])
def test_record_replaces_only_a_recording(tmp_path: Path, suffix) -> None:
    path = tmp_path / f"ref{suffix}"
    check_record_path(path)  # new file: fine
    path.write_text(USER)
    with pytest.raises(ValueError, match=r"exists and is not an mlaq recording.*--overwrite"):
        check_record_path(path)
    check_record_path(path, overwrite=True)
    save_recording(path, _recording())
    check_record_path(path)  # its own recording: replaceable
    assert load_recording(path).windows[0].tokens == (3, 4, 5)


def test_validate_server_record_over_a_users_file_is_one_line_before_measuring(tmp_path: Path) -> None:
    user = tmp_path / "notes.json"
    user.write_text(USER)
    # no server listens on port 9: a check made before measuring is all that can answer
    r = run_mlaq("validate", "--server", "http://127.0.0.1:9", "--record", str(user), "--no-progress")
    _one_line_error(r, "notes.json", "not an mlaq recording")
    assert user.read_text() == USER
    r = run_mlaq("validate", "--server", "http://127.0.0.1:9", "--record", str(tmp_path / "r.txt"))
    _one_line_error(r, "r.txt", ".safetensors")


@pytest.mark.parametrize("suffix", [".safetensors", ".json"])
def test_a_truncated_recording_is_one_line(tmp_path: Path, suffix) -> None:
    path = tmp_path / f"ref{suffix}"
    save_recording(path, _recording())
    data = path.read_bytes()
    for cut in (len(data) // 2, len(data) - 8, 12):
        path.write_bytes(data[:cut])
        with pytest.raises(
            ValueError, match=r"--against .*(not an mlaq validate recording|incomplete)"
        ) as info:
            load_recording(path)
        assert "\n" not in str(info.value)

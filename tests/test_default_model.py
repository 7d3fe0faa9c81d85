"""Every command that takes a MODEL defaults to the bundled mlaq-tiny-4k (explain, generate, validate and its
--server eval text, serve); bench-bmm times fixed geometries and audit needs a CHECKPOINT, so they have none."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

import mlaq
from mlaq.cli import build_parser, main

DEFAULT = Path(mlaq.__file__).resolve().parent / "assets" / "mlaq-tiny-4k"


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_explain_without_model_explains_the_bundled_4k_model(capsys, monkeypatch) -> None:
    for name in ("MLAQ_FP8BMM", "MLAQ_FP4BMM"):
        monkeypatch.delenv(name, raising=False)
    assert main(["explain"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "mlaq-tiny-4k" in lines[0] and "model_type deepseek_v3" in lines[0]
    assert lines[1].startswith("MLA layers:  5 (4 decoder + 1 MTP)")


def test_generate_without_model_runs_the_bundled_4k_model(capsys) -> None:
    """--max-model-len 4096 is refused by any model with a shorter context (mlaq-tiny: 2048)."""
    rc = main(["generate", "--prompt", "import os\n", "--max-tokens", "2", "--max-model-len", "4096"])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("--- prompt 0 (") and "-> 2 tokens" in out


def test_validate_defaults_to_the_4k_model_and_its_code_heldout() -> None:
    from mlaq.cli.validate import config_from_args

    cfg = config_from_args(_args("validate"))
    assert cfg.model.resolve() == DEFAULT and cfg.eval_text.name == "heldout.txt"
    prose = str(DEFAULT / "heldout-prose.txt")
    assert config_from_args(_args("validate", "--eval-text", prose)).eval_text == Path(prose)


def test_validate_server_default_eval_text_is_the_4k_models() -> None:
    from mlaq.bundled import bundled_model_dir
    from mlaq.validate.config import default_eval_text

    # validate/server/measure.py: `cfg.eval_text or default_eval_text(bundled_model_dir())`
    assert default_eval_text(bundled_model_dir()).resolve() == DEFAULT / "heldout.txt"


def test_serve_without_model_serves_the_4k_model(monkeypatch) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("prometheus_client")
    import mlaq.serve.server as server

    class Stop(Exception):
        pass

    seen = {}

    def fake_build_state(engine_args, *a, **kw):
        seen["model"] = engine_args.model
        raise Stop  # before any weight is read or a port is bound

    monkeypatch.setattr(server, "build_state", fake_build_state)
    from mlaq.cli import serve

    with pytest.raises(Stop):
        serve.run(_args("serve", "--port", "0"))
    assert Path(seen["model"]).resolve() == DEFAULT


def test_commands_without_a_model_default() -> None:
    assert "model" not in vars(_args("bench-bmm"))
    from mlaq.bundled import model_or_default

    args = _args("audit")  # audit too: no CHECKPOINT means the bundled model, resolved when it runs
    assert args.checkpoint is None and Path(model_or_default(args.checkpoint)).resolve() == DEFAULT


def test_a_bundled_name_resolves_unless_a_local_path_has_it(tmp_path, monkeypatch) -> None:
    from mlaq.bundled import bundled_model_dir, model_or_default

    monkeypatch.chdir(tmp_path)
    assert Path(model_or_default("mlaq-tiny-16k")) == bundled_model_dir("mlaq-tiny-16k")
    assert model_or_default("no-such-model") == "no-such-model"  # left to the loader's own error
    (tmp_path / "mlaq-tiny-16k").mkdir()  # a local directory of that name wins
    assert model_or_default("mlaq-tiny-16k") == "mlaq-tiny-16k"


def test_validate_takes_a_bundled_name() -> None:
    from mlaq.bundled import bundled_model_dir
    from mlaq.cli.validate import config_from_args

    cfg = config_from_args(_args("validate", "mlaq-tiny-16k"))
    assert Path(cfg.model).resolve() == bundled_model_dir("mlaq-tiny-16k").resolve()

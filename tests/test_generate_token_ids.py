"""``mlaq generate --prompt-token-ids``: a checkpoint without tokenizer.json runs from the CLI."""

from __future__ import annotations

import pytest

from mlaq.cli import main
from model_helpers import hf_checkpoint


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    _, path = hf_checkpoint("deepseek_v3", tmp_path_factory.mktemp("bare"), num_hidden_layers=2)
    assert not (path / "tokenizer.json").exists()
    return path


def test_token_ids_without_tokenizer(bare, capsys):
    rc = main(
        [
            "generate",
            str(bare),
            "--prompt-token-ids",
            "5,6,7",
            "--prompt-token-ids",
            "[1, 2]",
            "--max-tokens",
            "3",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    heads = [ln for ln in out.splitlines() if ln.startswith("--- prompt")]
    assert [h.split("(")[1].split(")")[0] for h in heads] == ["3 tokens", "2 tokens"]
    assert "-> 3 tokens" in heads[0]
    ids = out.splitlines()[1].split()
    assert len(ids) == 3 and all(i.isdigit() and int(i) < 96 for i in ids)  # greedy ids as text


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "either as --prompt TEXT or as --prompt-token-ids IDS"),
        (
            ["--prompt", "x", "--prompt-token-ids", "1"],
            "either as --prompt TEXT or as --prompt-token-ids IDS",
        ),
        (["--prompt-token-ids", "1", "--chat"], "--chat wraps text prompts"),
    ],
)
def test_prompt_choice_errors(bare, capsys, argv, message):
    rc = main(["generate", str(bare), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1


def test_bad_token_ids_is_an_argparse_error(bare, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", str(bare), "--prompt-token-ids", "1,x"])
    assert exc.value.code == 2
    assert "expected non-negative integers like 1,2,3" in capsys.readouterr().err

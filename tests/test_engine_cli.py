"""``mlaq generate`` on a tiny checkpoint with a tokenizer.json and a chat template."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from model_helpers import add_mtp_layer, hf_checkpoint

CORPUS = ["the cat sat on the mat", "a dog ran in the park", "latent attention caches tokens"] * 10
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = tmp_path_factory.mktemp("ckpt")
    model, _ = hf_checkpoint("deepseek_v3", path, num_hidden_layers=2)
    add_mtp_layer(model, path)
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Metaspace()
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=90, special_tokens=["<unk>", "<eos>"]))
    assert tk.get_vocab_size() <= 96  # the model's vocabulary
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": TEMPLATE}))
    return path


def test_generate_with_mtp_prints_text_and_vllm_metrics(mlaq_cli, checkpoint):
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    r = mlaq_cli(
        "generate", str(checkpoint), "--prompt", "the cat", "--prompt", "a dog ran",
        "--max-tokens", "6", "--speculative-config", spec,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("--- prompt") == 2
    assert "SpecDecoding metrics: Mean acceptance length: " in r.stdout
    assert "Avg Draft acceptance rate: " in r.stdout


def test_generate_chat_stream_and_fp8_cache(mlaq_cli, checkpoint):
    r = mlaq_cli(
        "generate", str(checkpoint), "--prompt", "the park", "--chat", "--stream",
        "--max-tokens", "4", "--kv-cache-dtype", "fp8_e4m3", "--temperature", "0.7", "--seed", "1",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "SpecDecoding" not in r.stdout


def test_generate_user_errors_are_one_line(mlaq_cli, checkpoint):
    r = mlaq_cli("generate", str(checkpoint), "--prompt", "x", "--speculative-config", '{"method": "ngram"}')
    assert r.returncode == 2 and "num_speculative_tokens" in r.stderr and "Traceback" not in r.stderr

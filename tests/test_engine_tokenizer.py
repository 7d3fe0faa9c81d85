"""Tokenizer wrapper, incremental detokenization, stop strings and chat templates, on a tiny BPE
tokenizer trained in the test with the `tokenizers` library."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlaq.engine.detokenizer import IncrementalDetokenizer
from mlaq.engine.sampling_params import SamplingParams
from mlaq.engine.tokenizer import Tokenizer, render_chat_template

tokenizers = pytest.importorskip("tokenizers")

CORPUS = [
    "Hello world. The quick brown fox jumps over the lazy dog.",
    "Multi-head latent attention caches one latent vector per token.",
    "café naïve résumé 🙂 中文 tokens",
] * 20
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tokenizer(path: Path, config: dict | None = None) -> Path:
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tk = Backend(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(CORPUS, trainer)
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    path.mkdir(parents=True, exist_ok=True)
    tk.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(
        path, {"bos_token": "<bos>", "eos_token": {"content": "<eos>"}, "chat_template": TEMPLATE}
    )
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    return Tokenizer.from_dir(path)


def stream(
    tok: Tokenizer, text: str, params: SamplingParams
) -> tuple[IncrementalDetokenizer, list[str], int]:
    """Feed ``text``'s tokens one at a time; return the detokenizer, the deltas, tokens consumed."""
    prompt = tok.encode("Hello")
    detok = IncrementalDetokenizer(tok, prompt, params)
    deltas, used = [], 0
    for token in tok.encode(text, add_special_tokens=False):
        used += 1
        stopped = detok.add_token(token)
        deltas.append(detok.next_delta(finished=stopped))
        if stopped:
            break
    deltas.append(detok.next_delta(finished=True))
    return detok, deltas, used


def test_loads_special_tokens_and_eos_ids(tok):
    assert tok.bos_token == "<bos>" and tok.eos_token == "<eos>"
    assert tok.eos_token_ids == (1, 7)  # generation_config first, the eos token's id already there
    ids = tok.encode("Hello world")
    assert ids[0] == 0 and tok.decode(ids) == "Hello world"
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>Hello world"


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json not found"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("text", ["The quick brown fox 🙂 jumps", "中文 café naïve résumé 🙂🙂 ok"])
def test_incremental_text_equals_full_decode_without_broken_characters(tok, text):
    detok, deltas, _ = stream(tok, text, SamplingParams())
    assert "".join(deltas) == text == detok.output_text
    assert not any("\ufffd" in d for d in deltas)
    assert len([d for d in deltas if d]) > 3  # it really streamed


def test_stop_string_straddling_tokens_is_cut_from_the_output(tok):
    text = "Hello world. The quick brown fox jumps over the lazy dog."
    stop = "own fox ju"
    pieces = [tok.decode([t]) for t in tok.encode(text, add_special_tokens=False)]
    assert not any(stop in p for p in pieces)  # the stop string really spans several tokens
    detok, deltas, used = stream(tok, text, SamplingParams(stop=["zzz", stop]))
    assert detok.output_text == "Hello world. The quick br" and detok.stop_reason == stop
    assert "".join(deltas) == detok.output_text
    ids = tok.encode(text, add_special_tokens=False)
    assert stop in tok.decode(ids[:used]) and stop not in tok.decode(ids[: used - 1])  # the completing token


def test_stream_holds_back_what_may_start_a_stop_string(tok):
    text = "The quick brown fox jumps over the lazy dog."
    _, deltas, _ = stream(tok, text, SamplingParams(stop=["lazy cat"]))
    assert "".join(deltas) == text  # never matched: everything comes out at the end
    running = "".join(deltas[:-1])
    assert len(running) <= len(text) - (len("lazy cat") - 1)


def test_include_stop_str_in_output(tok):
    detok, _, _ = stream(
        tok, "Hello world. The quick", SamplingParams(stop="world", include_stop_str_in_output=True)
    )
    assert detok.output_text == "Hello world"


def test_eos_text_is_not_added(tok):
    detok = IncrementalDetokenizer(tok, tok.encode("Hi"), SamplingParams())
    for t in tok.encode("Hello", add_special_tokens=False):
        detok.add_token(t)
    assert detok.add_token(1, skip_text=True) is False
    assert detok.output_text == "Hello"


def test_chat_template_renders(tok):
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages) == "<bos><|user|>Hi<eos><|assistant|>"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == "<bos><|user|>Hi<eos>"


def test_chat_template_sources_and_errors(tmp_path):
    plain = Tokenizer.from_dir(write_tokenizer(tmp_path / "plain"))
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "x"}])
    listed = write_tokenizer(tmp_path / "listed", {"chat_template": [{"name": "default", "template": "D"}]})
    assert Tokenizer.from_dir(listed).chat_template == "D"
    (listed / "chat_template.jinja").write_text("J{{ messages|length }}")
    assert Tokenizer.from_dir(listed).apply_chat_template([{}, {}]) == "J2"
    with pytest.raises(ValueError, match="chat template error: no system role"):
        render_chat_template("{{ raise_exception('no system role') }}", [])
    bad = write_tokenizer(tmp_path / "bad")
    (bad / "tokenizer_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        Tokenizer.from_dir(bad)


def test_prompt_context_keeps_a_sentencepiece_leading_space(tmp_path):
    """Metaspace decoders drop the first token's leading space; the prompt's tail is context."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tk = Backend(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tk.train_from_iterator(["Hello world again and again"] * 10, trainers.BpeTrainer(vocab_size=60))
    tk.save(str(tmp_path / "tokenizer.json"))
    sp = Tokenizer.from_dir(tmp_path)
    ids = sp.encode("Hello world again")
    detok = IncrementalDetokenizer(sp, ids[:1], SamplingParams())
    for t in ids[1:]:
        detok.add_token(t)
    assert detok.output_text == " world again"  # not "world again"

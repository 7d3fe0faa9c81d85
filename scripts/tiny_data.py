"""Corpus and tokenizer for mlaq-tiny: Python stdlib source, byte-level BPE, fixed held-out packages."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Top-level stdlib packages/modules never trained on; their source (fixed order) is heldout.txt.
HELDOUT = ("csv", "html", "http", "json", "textwrap", "tomllib")
# Skipped entirely: codec tables, pydoc's text dump, installed packages.
EXCLUDED = ("encodings", "pydoc_data", "site-packages", "dist-packages", "__pycache__")
TESTS = "test"  # the stdlib's test suite is trained on, except the tests of held-out modules
SPECIAL = ("<|bos|>", "<|eos|>", "<|pad|>")


def stdlib_dir() -> Path:
    """The running interpreter's standard-library source directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path, suffix: str) -> list[Path]:
    """All files with `suffix` under root, sorted by relative path (deterministic order)."""
    return sorted(
        (p for p in root.rglob(f"*{suffix}") if p.is_file()), key=lambda p: p.relative_to(root).as_posix()
    )


def top_name(root: Path, path: Path) -> str:
    """Top-level package or module name of `path` (json/decoder.py -> json, csv.py -> csv)."""
    first = path.relative_to(root).parts[0]
    return first.removesuffix(".py")


def document(root: Path, path: Path) -> str:
    """One file as it appears in the text stream: a header line, then its source."""
    text = path.read_text(encoding="utf-8", errors="replace")
    return f"# file: {path.relative_to(root).as_posix()}\n{text}\n"


def tests_held_out_code(parts: tuple[str, ...], heldout: tuple[str, ...]) -> bool:
    """True for test-suite files about a held-out module (test/test_json/..., test/test_httplib.py):
    they quote its identifiers and behaviour, so they are not trained on either."""
    names = [part.removesuffix(".py").removeprefix("test_") for part in parts[1:]]
    return parts[0] == TESTS and any(n.startswith(h) for n in names for h in heldout)


def split_corpus(
    root: Path, suffix: str, heldout: tuple[str, ...], tests: bool = True
) -> tuple[list[Path], list[Path]]:
    """(train files, held-out files); excluded names are dropped, the test suite unless `tests`."""
    train, held = [], []
    for p in list_files(root, suffix):
        parts = p.relative_to(root).parts
        if any(part in EXCLUDED for part in parts) or tests_held_out_code(parts, heldout):
            continue
        if parts[0] == TESTS and not tests:
            continue
        (held if top_name(root, p) in heldout else train).append(p)
    if not train:
        raise ValueError(f"no training files (*{suffix}) under {root}; pass --corpus DIR with text files")
    return train, held


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenizer, no prefix space); special tokens get ids 0..2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """Concatenated token ids of all texts, uint16 (vocab < 65536)."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
    return np.asarray(ids, dtype=np.uint16)


# The bundled models are trained on code, not chats: the template writes each turn as a comment line, so
# that /v1/chat/completions (and a chat client) works; what the model answers is still code completion.
CHAT_TEMPLATE = (
    "{% for message in messages %}# {{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}"
)


def tokenizer_config(max_len: int) -> dict:
    """tokenizer_config.json for transformers' PreTrainedTokenizerFast (a plain chat template, no auto BOS)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL[0],
        "eos_token": SPECIAL[1],
        "pad_token": SPECIAL[2],
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }

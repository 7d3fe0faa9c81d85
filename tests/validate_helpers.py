"""A tiny random checkpoint for the ``mlaq validate`` tests: transformers' weights, an MTP layer, a
character-level tokenizer.json over the 96-token vocabulary, and a held-out text beside it."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from mlaq.validate.config import ValidateConfig
from mlaq.validate.shape import RunShape
from model_helpers import add_mtp_layer, edit_config, hf_checkpoint

_SHAPE = {f.name for f in fields(RunShape)}

CHARS = [chr(c) for c in range(32, 127)] + ["\n"]  # 96 symbols = the test vocabulary
MAX_POSITIONS = 256
# the per-scheme keys issue 7 promises in `mlaq validate --json`
PER_SCHEME = (
    "attn_rel_err",
    "kl",
    "top1_agreement",
    "nll_delta",
    "acceptance_rate",
    "mean_acceptance_length",
)


def write_char_tokenizer(path: Path) -> None:
    """tokenizer.json: one token per character (unknown characters -> "?")."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": None}))


def eval_text(lines: int = 120) -> str:
    """Deterministic, code-like text with some repetition (what the held-out file looks like)."""
    out = []
    for i in range(lines):
        out.append(f"def f{i % 17}(x, y={i % 5}):\n    return x * {i % 11} + y - {(i * 7) % 13}\n")
    return "".join(out)


def tiny_checkpoint(
    path: Path, model_type: str = "deepseek_v3", *, mtp: bool = True, **overrides: object
) -> Path:
    """A random ``model_type`` checkpoint with one MTP layer (unless ``mtp=False``: transformers then
    saves none), tokenizer.json and heldout.txt."""
    layers = {"num_hidden_layers": 2}
    if model_type == "glm_moe_dsa":  # the MTP layer copies the last layer: give it a full indexer
        layers = {"num_hidden_layers": 3, "indexer_types": ["full", "shared", "full"]}
    model, _ = hf_checkpoint(
        model_type, path, **{**layers, "max_position_embeddings": MAX_POSITIONS, **overrides}
    )
    if mtp:
        add_mtp_layer(model, path, shards=1)
    edit_config(path, torch_dtype="bfloat16")  # the reference runs in bf16 either way
    write_char_tokenizer(path)
    (path / "heldout.txt").write_text(eval_text())
    return path


def local_config(model: Path, **kw: Any) -> ValidateConfig:
    """A ValidateConfig of ``model`` and its held-out text; ``kw`` mixes the run shape's fields (windows,
    context_len, ...) and the local config's (schemes, num_speculative_tokens, ...)."""
    shape = {"eval_text": model / "heldout.txt", **{k: v for k, v in kw.items() if k in _SHAPE}}
    return ValidateConfig(
        model=model, shape=RunShape(**shape), **{k: v for k, v in kw.items() if k not in _SHAPE}
    )


def reshaped(cfg: ValidateConfig, **kw: Any) -> ValidateConfig:
    """``dataclasses.replace`` of a ValidateConfig whose ``kw`` may name the run shape's fields too."""
    shape = replace(cfg.shape, **{k: v for k, v in kw.items() if k in _SHAPE})
    return replace(cfg, shape=shape, **{k: v for k, v in kw.items() if k not in _SHAPE})

"""Smoke checks of the shipped mlaq-tiny checkpoint (files, geometry, dtypes, MTP keys, tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

import mlaq

ASSET = Path(mlaq.__file__).resolve().parent / "assets" / "mlaq-tiny"
FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "README.md",
    "heldout.txt",
)
MTP_ONLY = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((ASSET / "config.json").read_text())


@pytest.fixture(scope="module")
def dtypes() -> dict[str, tuple[str, list[int]]]:
    with safe_open(str(ASSET / "model.safetensors"), "pt") as f:
        return {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118


def test_asset_files_present() -> None:
    missing = [name for name in FILES if not (ASSET / name).is_file()]
    assert not missing, f"missing from {ASSET}: {missing}"


def test_config_is_deepseek_v3_with_mla_geometry(config: dict) -> None:
    c = config
    assert c["model_type"] == "deepseek_v3" and c["architectures"] == ["DeepseekV3ForCausalLM"]
    for key, floor in (
        ("kv_lora_rank", 128),
        ("qk_nope_head_dim", 64),
        ("qk_rope_head_dim", 32),
        ("v_head_dim", 64),
    ):
        assert c[key] >= floor and c[key] % 32 == 0, f"{key}={c[key]}"
    assert c["num_attention_heads"] >= 4 and 4 <= c["num_hidden_layers"] <= 8
    assert c["first_k_dense_replace"] == 1 and c["n_routed_experts"] >= 4 and c["n_shared_experts"] >= 1
    assert c["scoring_func"] == "sigmoid" and c["topk_method"] == "noaux_tc"
    assert c["n_routed_experts"] % c["n_group"] == 0 and c["topk_group"] <= c["n_group"]
    assert c["num_experts_per_tok"] <= c["topk_group"] * c["n_routed_experts"] // c["n_group"]
    assert c["num_nextn_predict_layers"] == 1 and c["max_position_embeddings"] >= 2048
    assert c["tie_word_embeddings"] is False


def test_weights_bf16_small_and_shaped(config: dict, dtypes: dict) -> None:
    size = (ASSET / "model.safetensors").stat().st_size
    assert size <= 25_000_000, f"model.safetensors is {size} bytes, over the 25 MB budget"
    # DeepSeek-V3 checkpoints keep the router correction bias in fp32; all else is bf16.
    wrong = {
        k: d
        for k, (d, _) in dtypes.items()
        if d != ("F32" if k.endswith("e_score_correction_bias") else "BF16")
    }
    assert not wrong, f"unexpected dtypes: {wrong}"
    c = config
    kv_b = dtypes["model.layers.0.self_attn.kv_b_proj.weight"][1]
    assert kv_b == [c["num_attention_heads"] * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]]


def test_mtp_layer_keys(config: dict, dtypes: dict) -> None:
    n = config["num_hidden_layers"]
    mtp = f"model.layers.{n}."
    for name in (
        *MTP_ONLY,
        "self_attn.kv_b_proj.weight",
        "mlp.gate.weight",
        "mlp.shared_experts.up_proj.weight",
    ):
        assert mtp + name in dtypes, f"MTP key {mtp + name} missing"
    assert dtypes[mtp + "eh_proj.weight"][1] == [config["hidden_size"], 2 * config["hidden_size"]]
    # The MTP layer reuses the main embedding and lm_head; none stored twice, no layer beyond it.
    assert not any(k.startswith(mtp) and ("embed_tokens" in k or "shared_head.head" in k) for k in dtypes)
    assert not any(k.startswith(f"model.layers.{n + 1}.") for k in dtypes)
    for i in range(n):
        assert not any(k.startswith(f"model.layers.{i}.") and k.endswith(MTP_ONLY) for k in dtypes)


def test_tokenizer_round_trips() -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ASSET / "tokenizer.json"))
    tok_cfg = json.loads((ASSET / "tokenizer_config.json").read_text())
    text = 'def f(x: int) -> str:\n    """Grüße, 世界 ✓"""\n\treturn f"{x!r:>8}"  # ok\n'
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text
    assert 4096 <= tok.get_vocab_size() <= 8192
    for key in ("bos_token", "eos_token"):
        assert tok.token_to_id(tok_cfg[key]) is not None, f"{key} {tok_cfg[key]!r} not in the vocabulary"


def test_heldout_text_and_package_data() -> None:
    text = (ASSET / "heldout.txt").read_text()
    assert 100_000 <= len(text.encode()) <= 1_000_000 and text.startswith("# file: ")
    pyproject = (Path(mlaq.__file__).resolve().parents[2] / "pyproject.toml").read_text()
    line = next(
        x for x in pyproject.splitlines() if x.startswith("mlaq = [")
    )  # [tool.setuptools.package-data]
    assert '"assets/mlaq-tiny/*"' in line, f"asset not package data: {line}"

"""Checkpoint layouts real tools write: Kimi-K2.5 (text model under ``language_model.`` beside a vision
tower, config under ``text_config``) and transformers 5's stacked experts (``mlp.experts.gate_up_proj``
[E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]). Each loads to the same logits as the plain layout."""

from __future__ import annotations

import json

import pytest
import torch

from mlaq.model.loading.loader import load_model
from mlaq.settings import Settings
from model_helpers import fused_experts, hf_checkpoint, read_tensors, write_tensors

IDS = torch.tensor([[3, 14, 15, 9, 2, 6]])


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    _, path = hf_checkpoint("kimi_k2", tmp_path_factory.mktemp("plain"))
    return path


def _same_model(a, b) -> None:
    """Every parameter bit-identical, and the logits equal up to fp32 summation order (1e-5)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa), [k for k in sa if not torch.equal(sa[k], sb[k])][:3]
    torch.testing.assert_close(a.prefill(IDS).logits, b.prefill(IDS).logits, rtol=0, atol=1e-5)


def _load(path):
    return load_model(path, settings=Settings())


def _rewrite(src, dst, tensors: dict[str, torch.Tensor], config: dict, shards: int = 1) -> None:
    dst.mkdir()
    write_tensors(dst, tensors, shards=shards)
    (dst / "config.json").write_text(json.dumps(config))


def test_stacked_experts_load_like_per_expert(plain, tmp_path):
    t = read_tensors(plain)
    cfg = json.loads((plain / "config.json").read_text())
    n_exp = cfg["n_routed_experts"]
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in t  # the per-expert layout to start from
    stacked: dict[str, torch.Tensor] = {}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        state = {k[len(p) :]: v for k, v in t.items() if k.startswith(p)}
        stacked.update({p + k: v for k, v in fused_experts(state, n_exp).items()})
    stacked.update({k: v for k, v in t.items() if not k.startswith("model.layers.")})
    assert "model.layers.1.mlp.experts.gate_up_proj" in stacked
    assert not any(".experts.0." in k for k in stacked)
    _rewrite(plain, tmp_path / "stacked", stacked, cfg)
    _same_model(_load(tmp_path / "stacked"), _load(plain))


def test_kimi_k25_layout_loads(plain, tmp_path):
    t = read_tensors(plain)
    text_cfg = json.loads((plain / "config.json").read_text())
    # the published layout: language_model.model.*, language_model.lm_head.weight, plus a vision tower
    tensors = {f"language_model.{k}": v for k, v in t.items()}
    tensors["vision_tower.patch_embed.weight"] = torch.randn(4, 3)
    tensors["mm_projector.proj.0.weight"] = torch.randn(4, 4)
    cfg = {
        "model_type": "kimi_k25",
        "architectures": ["KimiK25ForConditionalGeneration"],
        "text_config": text_cfg,
        "vision_config": {"hidden_size": 4},
        "torch_dtype": text_cfg.get("torch_dtype", "float32"),
    }
    _rewrite(plain, tmp_path / "k25", tensors, cfg, shards=2)
    assert (tmp_path / "k25" / "model.safetensors.index.json").is_file()
    model = load_model(tmp_path / "k25", settings=Settings())
    assert model.bmm_decisions[0].module == "language_model.model.layers.0.self_attn.kv_b_proj"
    _same_model(model, _load(plain))

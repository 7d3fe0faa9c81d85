"""``prefill_cache``: the cache a decode continues, filled without the last layer's outputs.

The decode after it must be bit for bit the decode after a full ``prefill`` (the task suite's scores
depend on it), on the bundled model in bf16 under a quantized scheme, and on random checkpoints of the
other MLA shapes (no q_lora; DSA with the last layer's own indexer or a shared one).
"""

from __future__ import annotations

import pytest
import torch

from mlaq.bundled import bundled_model_dir
from mlaq.model import ModelCache, load_model
from mlaq.settings import Settings

pytest.importorskip("transformers")
from model_helpers import hf_checkpoint

OFF = Settings(fp8bmm=False, fp4bmm=False)


def _ids(vocab: int, b: int, t: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(2, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def _caches_and_decode(model, ids: torch.Tensor, keep: int) -> tuple[dict, dict, torch.Tensor, torch.Tensor]:
    full, lean = ModelCache(), ModelCache()
    model.prefill(ids[:, :keep], full)
    model.prefill_cache(ids[:, :keep], lean)
    n = model.config.num_hidden_layers
    before = {i: full.get(i) for i in range(n)}, {i: lean.get(i) for i in range(n)}
    out_full = model.decode(ids[:, keep:], full).logits
    out_lean = model.decode(ids[:, keep:], lean).logits
    return *before, out_full, out_lean


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for i in a:
        assert torch.equal(a[i].latent, b[i].latent), f"layer {i}: latent cache differs"
        assert (a[i].index_keys is None) == (b[i].index_keys is None), f"layer {i}"
        if a[i].index_keys is not None:
            assert torch.equal(a[i].index_keys, b[i].index_keys), f"layer {i}: index keys differ"


@pytest.mark.parametrize("scheme", ["bf16", "mxfp4"])
def test_bundled_model_decodes_the_same_bits(scheme):
    model = load_model(bundled_model_dir(), dtype=torch.bfloat16, settings=Settings())
    for layer in model.model.layers:
        layer.self_attn.prepare(scheme)
    ids = _ids(model.config.vocab_size, 2, 400)
    full, lean, out_full, out_lean = _caches_and_decode(model, ids, 384)
    _assert_same(full, lean)
    assert torch.equal(out_full, out_lean)


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        ("deepseek_v2", {"num_hidden_layers": 2}),  # no q_lora
        ("glm_moe_dsa", {"num_hidden_layers": 3, "indexer_types": ["full", "shared", "full"]}),
        ("glm_moe_dsa", {"num_hidden_layers": 2, "indexer_types": ["full", "shared"]}),
        ("deepseek_v3", {"num_hidden_layers": 1}),  # the only layer is the last
    ],
)
def test_random_checkpoints_decode_the_same_bits(model_type, overrides, tmp_path):
    _, path = hf_checkpoint(model_type, tmp_path, **overrides)
    model = load_model(path, settings=OFF)
    ids = _ids(model.config.vocab_size, 2, 24)
    full, lean, out_full, out_lean = _caches_and_decode(model, ids, 20)
    _assert_same(full, lean)
    assert torch.equal(out_full, out_lean)


def test_the_last_layer_outputs_and_the_head_are_not_computed():
    model = load_model(bundled_model_dir(), dtype=torch.bfloat16, settings=Settings())
    ran: list[str] = []
    last = model.model.layers[model.config.num_hidden_layers - 1]
    watched = {
        "first mlp": model.model.layers[0].mlp,
        "last mlp": last.mlp,
        "last o_proj": last.self_attn.o_proj,
        "last q_b_proj": last.self_attn.q_b_proj,
        "norm": model.model.norm,
        "lm_head": model.lm_head,
    }
    for name, module in watched.items():
        module.register_forward_hook(lambda *_, name=name: ran.append(name))
    model.prefill_cache(_ids(model.config.vocab_size, 1, 32), ModelCache())
    assert ran == ["first mlp"]

"""The MTP layer against a direct computation from its definition (transformers ignores MTP layers).

Definition (DeepSeek-V3 §2.2, engines.md): y = block(eh_proj(concat(enorm(embed(x_{t+1})), hnorm(h_t)))),
logits = head(shared_head.norm(y)), with h_t the target's hidden state after its final norm. The block is
run by transformers' own decoder layer of the same architecture, loaded with the MTP layer's tensors.
"""

from __future__ import annotations

import pytest
import torch

from mlaq.model import AttnPath, ModelCache, load_model
from mlaq.settings import Settings
from model_helpers import add_mtp_layer, fused_experts, hf_checkpoint, read_tensors, write_tensors

OFF = Settings(fp8bmm=False, fp4bmm=False)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _reference_mtp(hf, mtp: dict, ids_next: torch.Tensor, hidden: torch.Tensor, own: bool) -> torch.Tensor:
    """MTP logits computed from the definition, the block by transformers' decoder layer."""
    cfg = hf.config
    n, eps = cfg.num_hidden_layers, cfg.rms_norm_eps
    p = f"model.layers.{n}."
    embed = mtp[p + "embed_tokens.weight"] if own else hf.model.embed_tokens.weight
    head = mtp[p + "shared_head.head.weight"] if own else hf.lm_head.weight
    e = _rms(embed[ids_next], mtp[p + "enorm.weight"], eps)
    h = _rms(hidden, mtp[p + "hnorm.weight"], eps)
    x = torch.cat((e, h), dim=-1) @ mtp[p + "eh_proj.weight"].T  # embedding first, then hidden
    block = type(hf.model.layers[-1])(cfg, layer_idx=n - 1)  # an MoE layer of the same architecture
    skip = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")
    state = {k[len(p) :]: v for k, v in mtp.items() if not k[len(p) :].startswith(skip)}
    block.load_state_dict(fused_experts(state, cfg.n_routed_experts))
    block.eval()
    b, t = ids_next.shape
    positions = torch.arange(t).expand(b, t)
    causal = torch.full((t, t), float("-inf")).triu(1).expand(b, 1, t, t)  # (B, 1, T, T) additive
    with torch.no_grad():
        pe = hf.model.rotary_emb(x, positions)
        y = block(x, attention_mask=causal, position_ids=positions, position_embeddings=pe)
        y = y[0] if isinstance(y, tuple) else y
    return _rms(y, mtp[p + "shared_head.norm.weight"], eps) @ head.T


@pytest.mark.parametrize(("model_type", "own"), [("deepseek_v3", True), ("deepseek_v32", False)])
def test_mtp_matches_definition(model_type, own, tmp_path):
    hf, path = hf_checkpoint(model_type, tmp_path)
    mtp = add_mtp_layer(hf, path, own_embed=own, own_head=own)
    model = load_model(path, settings=OFF)
    n = hf.config.num_hidden_layers
    assert model.num_mtp_layers == 1
    assert [d.layer for d in model.bmm_decisions] == list(range(n + 1))  # MTP layer decided too
    assert (model.model.layers[n].embed_tokens is not None) == own
    assert (model.model.layers[n].shared_head.head is not None) == own

    ids = torch.randint(0, hf.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    cache = ModelCache()
    target = model.prefill(ids[:, :-1], cache)  # hidden h_0..h_{T-1}, after model.norm
    out = model.mtp_step(ids[:, 1:], target.hidden, cache, path=AttnPath.NAIVE)
    with torch.no_grad():
        ref = _reference_mtp(hf, mtp, ids[:, 1:], target.hidden, own)
    rel = float((out.logits - ref).abs().max() / ref.abs().max())
    assert rel <= 1e-4, f"MTP logits differ from the definition by {rel:.2e}"
    assert cache.length(n) == ids.shape[1] - 1  # the MTP layer keeps its own latent cache


def test_mtp_decode_continues_its_cache(tmp_path):
    """MTP over a prompt (naive) then one absorbed MTP step == one naive MTP pass over everything."""
    hf, path = hf_checkpoint("deepseek_v3", tmp_path)
    add_mtp_layer(hf, path)
    model = load_model(path, settings=OFF)
    ids = torch.randint(0, hf.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(3))
    hidden = model.prefill(ids[:, :-1]).hidden  # (1, 7, H)
    full = model.mtp_step(ids[:, 1:], hidden, ModelCache(), path=AttnPath.NAIVE).logits
    cache = ModelCache()
    model.mtp_step(ids[:, 1:-1], hidden[:, :-1], cache, path=AttnPath.NAIVE)
    last = model.mtp_step(ids[:, -1:], hidden[:, -1:], cache).logits  # absorbed, position 6
    assert float((last[:, 0] - full[:, -1]).abs().max() / full.abs().max()) <= 1e-5


def test_mtp_weights_required_when_asked(tmp_path):
    _hf, path = hf_checkpoint("deepseek_v3", tmp_path)
    model = load_model(path, settings=OFF)  # transformers saved no MTP tensors: loads without MTP
    assert model.num_mtp_layers == 0
    with pytest.raises(ValueError, match="no MTP layer"):
        model.mtp_step(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, 64), ModelCache())
    with pytest.raises(ValueError, match=r"model\.layers\.3\.eh_proj\.weight.*missing"):
        load_model(path, settings=OFF, load_mtp=True)


def test_partial_mtp_layer_is_an_error(tmp_path):
    hf, path = hf_checkpoint("deepseek_v3", tmp_path)
    add_mtp_layer(hf, path)
    tensors = read_tensors(path)
    del tensors["model.layers.3.self_attn.kv_b_proj.weight"]
    write_tensors(path, tensors)
    with pytest.raises(ValueError, match=r"model\.layers\.3\.self_attn\.kv_b_proj\.weight.*missing"):
        load_model(path, settings=OFF)
    assert load_model(path, settings=OFF, load_mtp=False).num_mtp_layers == 0

"""mlaq vs transformers (the oracle) on tiny random checkpoints of every supported architecture.

Logits over a prompt must agree to 1e-4 of the logit scale in fp32, for prefill (naive MLA) and for
token-by-token decode (absorbed MLA through the fp32 BMM scheme). The DSA architectures use
index_topk=4 < the prompt length, so the indexer's selection is exercised.
"""

from __future__ import annotations

import pytest
import torch

from mlaq.model import ModelCache, load_model
from mlaq.settings import Settings
from model_helpers import ARCHS, hf_checkpoint

TOL = 1e-4
OFF = Settings(fp8bmm=False, fp4bmm=False)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_logits_match_transformers(model_type, tmp_path):
    hf, path = hf_checkpoint(model_type, tmp_path)
    model = load_model(path, settings=OFF)
    assert model.config.model_type == model_type
    assert {d.scheme for d in model.bmm_decisions} == {"fp32"}  # fp32 checkpoint: nothing quantized
    ids = torch.randint(0, hf.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids)
        ref_hidden = hf.model(ids).last_hidden_state

    out = model.prefill(ids)
    assert _rel(out.logits, ref.logits) <= TOL, f"prefill: {_rel(out.logits, ref.logits):.2e}"
    assert _rel(out.hidden, ref_hidden) <= TOL  # the hidden state MTP consumes: after model.norm

    cache = ModelCache()
    steps = [model.prefill(ids[:, :4], cache).logits]
    for t in range(4, ids.shape[1]):
        steps.append(model.decode(ids[:, t : t + 1], cache).logits)
    decoded = torch.cat(steps, dim=1)
    assert _rel(decoded, ref.logits) <= TOL, f"decode: {_rel(decoded, ref.logits):.2e}"
    assert cache.length(0) == ids.shape[1]


def test_multi_token_decode_matches_one_pass(tmp_path):
    """Absorbed decode of several tokens at once (speculative verification) == one naive pass."""
    hf, path = hf_checkpoint("glm_moe_dsa", tmp_path)
    model = load_model(path, settings=OFF)
    ids = torch.randint(0, hf.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(1))
    full = model.prefill(ids).logits
    cache = ModelCache()
    first = model.prefill(ids[:, :6], cache).logits
    rest = model.decode(ids[:, 6:], cache).logits  # 4 query tokens, causal among themselves
    assert _rel(torch.cat((first, rest), 1), full) <= TOL


def test_tied_embeddings(tmp_path):
    hf, path = hf_checkpoint("glm4_moe_lite", tmp_path, tie_word_embeddings=True)
    model = load_model(path, settings=OFF)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, hf.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
    assert _rel(model.prefill(ids).logits, ref) <= TOL


def test_cache_truncate_forgets_rejected_tokens(tmp_path):
    """Rolling the cache back (rejected speculative tokens) then decoding == never having seen them."""
    hf, path = hf_checkpoint("deepseek_v32", tmp_path)
    model = load_model(path, settings=OFF)
    ids = torch.randint(0, hf.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    full = model.prefill(ids).logits
    cache = ModelCache()
    model.prefill(torch.cat((ids[:, :6], ids[:, :3]), dim=1), cache)  # 3 wrong tokens after position 5
    cache.truncate(6)
    assert cache.length(0) == 6 and cache.get(0).index_keys.shape[1] == 6
    rest = model.decode(ids[:, 6:], cache).logits
    assert _rel(rest, full[:, 6:]) <= TOL

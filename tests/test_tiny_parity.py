"""The default bundled checkpoint (mlaq-tiny-4k: DeepSeek-V3's real MLA geometry, kv_lora_rank 512, rope 64,
and its RoPE / YaRN as config.json says): mlaq's logits equal transformers' (the oracle nobody here wrote).
The older mlaq-tiny stays loadable by path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mlaq
from mlaq.bundled import bundled_model_dir
from mlaq.model import ModelCache, load_model
from mlaq.settings import Settings

TINY = bundled_model_dir()
OLD = Path(mlaq.__file__).parent / "assets" / "mlaq-tiny"
FP32_BMM = '{"targets": {"re:.*kv_b_proj": "fp32"}}'  # exact absorbed arithmetic: parity, not bf16 rounding
TOL = 1e-4


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.abs().max())


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    from tokenizers import Tokenizer

    text = (TINY / "heldout.txt").read_text()[:4000]
    return torch.tensor([Tokenizer.from_file(str(TINY / "tokenizer.json")).encode(text).ids[:48]])


def test_bundled_model_matches_transformers(ids):
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    model = load_model(TINY, dtype=torch.float32, settings=Settings(), quantization_config=FP32_BMM)
    assert {d.scheme for d in model.bmm_decisions} == {"fp32"}
    with torch.no_grad():
        ref = hf(ids).logits
    assert _rel(model.prefill(ids).logits, ref) <= TOL  # naive MLA

    cache = ModelCache()
    steps = [model.prefill(ids[:, :16], cache).logits]
    steps += [model.decode(ids[:, t : t + 1], cache).logits for t in range(16, ids.shape[1])]
    assert _rel(torch.cat(steps, dim=1), ref) <= TOL  # absorbed MLA, token by token


@pytest.mark.parametrize("path", [TINY, OLD], ids=["mlaq-tiny-4k", "mlaq-tiny"])
def test_bundled_models_load_their_mtp_layer(path, ids):
    model = load_model(path, settings=Settings())
    assert len(model.bmm_decisions) == model.config.num_hidden_layers + 1  # the MTP layer is an MLA layer too
    out = model.prefill(ids)
    assert torch.isfinite(out.logits).all() and out.logits.shape[-1] == model.config.vocab_size

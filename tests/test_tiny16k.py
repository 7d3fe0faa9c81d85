"""The bundled mlaq-tiny-16k: mlaq-tiny-4k extended to 16,384 tokens with DeepSeek-V3's YaRN. Its config is
the rope_scaling DeepSeek ships (type yarn, factor, original context, beta_fast / beta_slow, mscale /
mscale_all_dim), mlaq reads it, and mlaq's logits equal transformers' past the original 4,096 positions,
where the interpolated frequencies and the softmax-scale correction decide the attention."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import mlaq
from mlaq.bundled import bundled_model_dir
from mlaq.model import ModelCache, load_model
from mlaq.model.layers.mla_config import MLAConfig
from mlaq.settings import Settings

LONG = Path(mlaq.__file__).parent / "assets" / "mlaq-tiny-16k"
FP32_BMM = '{"targets": {"re:.*kv_b_proj": "fp32"}}'  # exact absorbed arithmetic: parity, not bf16 rounding


def test_config_is_deepseek_v3s_yarn_over_the_4k_model():
    c = json.loads((LONG / "config.json").read_text())
    rope = c["rope_parameters"]
    assert bundled_model_dir("mlaq-tiny-16k") == LONG
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0
    assert rope["original_max_position_embeddings"] == 4096 and c["max_position_embeddings"] == 16384
    assert (rope["beta_fast"], rope["beta_slow"], rope["mscale"], rope["mscale_all_dim"]) == (32, 1, 1, 1)
    base = json.loads((bundled_model_dir("mlaq-tiny-4k") / "config.json").read_text())
    same = ("hidden_size", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "vocab_size")
    assert all(c[k] == base[k] for k in same)
    tok = (LONG / "tokenizer.json").read_text()
    assert tok == (bundled_model_dir("mlaq-tiny-4k") / "tokenizer.json").read_text()
    mla = MLAConfig.from_hf(c)
    m = 0.1 * math.log(4.0) + 1  # yarn_get_mscale(4, mscale_all_dim=1)
    assert mla.softmax_scale == pytest.approx(192**-0.5 * m * m, rel=1e-12)
    assert mla.rope_scaling.cos_sin_scale == 1.0  # mscale == mscale_all_dim


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    from tokenizers import Tokenizer

    text = (LONG / "heldout.txt").read_text()
    return torch.tensor([Tokenizer.from_file(str(LONG / "tokenizer.json")).encode(text).ids[:4160]])


def test_matches_transformers_past_the_original_context(ids):
    """fp32, 4,160 tokens: the naive prefill and the absorbed decode of the last 32 positions (4,128 to
    4,159, beyond the 4,096 the model was first trained at) give transformers' logits."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(LONG, dtype=torch.float32).eval()
    model = load_model(LONG, dtype=torch.float32, settings=Settings(), quantization_config=FP32_BMM)
    with torch.no_grad():
        ref = hf(ids).logits[:, -32:]
    rel = lambda a: float((a - ref).abs().max() / ref.abs().max())  # noqa: E731
    assert rel(model.prefill(ids).logits[:, -32:]) <= 1e-4
    cache = ModelCache()
    model.prefill(ids[:, :-32], cache)
    steps = [model.decode(ids[:, t : t + 1], cache).logits for t in range(ids.shape[1] - 32, ids.shape[1])]
    assert rel(torch.cat(steps, dim=1)) <= 1e-4

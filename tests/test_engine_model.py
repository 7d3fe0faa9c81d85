"""The engine on real (tiny, random) DeepSeek-family checkpoints written by transformers."""

from __future__ import annotations

import pytest
import torch

from mlaq.engine.llm import LLM
from mlaq.engine.sampling_params import SamplingParams
from mlaq.model import ModelCache, load_model

pytest.importorskip("transformers")
from model_helpers import add_mtp_layer, hf_checkpoint

PROMPTS = [[5, 17, 3, 88, 41, 9, 30], [12], [7, 7, 60, 2, 95, 14, 33, 21, 8, 40, 1], [70, 3, 19]]
MAX_TOKENS = 10


@pytest.fixture(scope="module", params=["deepseek_v3", "glm_moe_dsa"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model, _ = hf_checkpoint(request.param, path, **_layers(request.param))
    add_mtp_layer(model, path)  # a copy of the last layer's tensor names (MoE; a full indexer for DSA)
    return path


def _layers(model_type: str) -> dict:
    if model_type == "glm_moe_dsa":  # the MTP layer has a full indexer: so must its template
        return {"num_hidden_layers": 3, "indexer_types": ["full", "shared", "full"]}
    return {"num_hidden_layers": 2}


def reference_greedy(path, prompt: list[int], n: int) -> list[int]:
    """The model's own API, one sequence, unpaged ModelCache: prefill then absorbed decode."""
    model = load_model(path)
    cache = ModelCache()
    out = model.prefill(torch.tensor([prompt]), cache)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < n:
        out = model.decode(torch.tensor([[tokens[-1]]]), cache)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def generate(path, k: int = 0, **kw) -> list[list[int]]:
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    llm = LLM(path, speculative_config=spec, max_model_len=64, block_size=4, **kw)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def test_batched_paged_greedy_matches_the_models_own_decode(checkpoint):
    assert generate(checkpoint) == [reference_greedy(checkpoint, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_greedy_equals_plain_greedy(checkpoint, k):
    assert generate(checkpoint, k) == generate(checkpoint)


def test_fp8_kv_cache_runs_and_mostly_agrees(checkpoint):
    fp8 = generate(checkpoint, kv_cache_dtype="fp8_e4m3")
    auto = generate(checkpoint)
    agree = sum(a == b for x, y in zip(fp8, auto, strict=True) for a, b in zip(x, y, strict=True))
    assert agree >= 0.5 * MAX_TOKENS * len(PROMPTS), (fp8, auto)


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory):
    """All-dense layers: MoE routing flips would turn a small perturbation into a jump in the logits."""
    path = tmp_path_factory.mktemp("dense")
    hf_checkpoint("deepseek_v3", path, num_hidden_layers=2, first_k_dense_replace=2)
    return path


def decode_logits(lm, tokens: list[int], kv: str, noise: float = 0.0) -> torch.Tensor:
    """Teacher-forced prefill of 4 tokens, then one decode step per token, through the paged cache."""
    from mlaq.engine.block_manager import BlockManager
    from mlaq.engine.kv_cache import LatentCacheConfig, LatentKVCache
    from mlaq.engine.runner import ModelRunner
    from mlaq.engine.sequence import Sequence

    g = lm.geometry
    blocks = BlockManager(16, 4, 64)
    cfg = LatentCacheConfig(g.num_layers, g.kv_lora_rank, g.qk_rope_head_dim, 16, 4, g.dtype, kv)
    cache = LatentKVCache(cfg)
    runner = ModelRunner(lm, cache, blocks, use_mtp=False)
    seq = Sequence(0, tokens[:4], SamplingParams())
    gen = torch.Generator().manual_seed(0)

    def perturb(start: int, end: int) -> None:  # multiplicative Gaussian noise on the new entries, once
        if noise:
            slots = blocks.slot_mapping(0, start, end)
            cache.data[:, slots] *= 1 + noise * torch.randn(cache.data[:, slots].shape, generator=gen)

    blocks.grow(0, 4)
    rows = [runner.forward([seq], [tokens[:4]], prefill=True).logits[0, -1]]
    perturb(0, 4)
    seq.num_cached = 4
    for i in range(4, len(tokens)):
        blocks.grow(0, i + 1)
        rows.append(runner.forward([seq], [[tokens[i]]], prefill=False).logits[0, 0])
        perturb(i, i + 1)
        seq.num_cached += 1
    return torch.stack(rows)  # (steps, V)


def test_fp8_kv_cache_error_on_decode_logits(dense_checkpoint):
    """auto vs fp8_e4m3 (scale 1.0): prefill reads no cache (identical logits); each decode step reads
    fp8 latents (~2.7 % relative RMS). The logits move about as much as under Gaussian noise of that
    size on the cache: the error is the format's, nothing else."""
    from mlaq.engine.adapter import DeepseekLatentLM

    lm = DeepseekLatentLM(load_model(dense_checkpoint))
    tokens = PROMPTS[2] + [4, 50, 61, 3, 90, 22, 17, 8]
    auto = decode_logits(lm, tokens, "auto")
    fp8 = decode_logits(lm, tokens, "fp8_e4m3")
    assert torch.equal(auto[0], fp8[0])  # prefill: no cache read

    def rel(x: torch.Tensor) -> float:
        return float((x[1:] - auto[1:]).norm() / auto[1:].norm())

    noise = rel(decode_logits(lm, tokens, "auto", noise=0.027))
    print(
        f"fp8 KV cache: relative logit error {rel(fp8):.4f}; 2.7 % Gaussian noise on the cache: {noise:.4f}"
    )
    assert 1e-3 < rel(fp8) < 3 * noise


def test_quantization_config_reaches_every_layer_mtp_included(checkpoint):
    qc = '{"targets": {"re:.*kv_b_proj.*": "fp8_per_tensor"}}'
    llm = LLM(
        checkpoint,
        quantization_config=qc,
        max_model_len=32,
        speculative_config={"method": "mtp", "num_speculative_tokens": 2},
    )
    layers = llm.engine.model.model.model.layers
    n = llm.engine.model.geometry.num_layers
    assert len(layers) == n + 1  # the MTP layer is loaded
    assert {layer.self_attn.absorbed.scheme_uk.name for layer in layers} == {"fp8_per_tensor"}
    out = llm.generate(
        {"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 4

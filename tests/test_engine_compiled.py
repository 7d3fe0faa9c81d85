"""``LLM(..., compile=True)``: decode / verification / MTP steps with their per-token pieces compiled give
eager's greedy tokens.

One tiny checkpoint (1 dense + 1 MoE layer + MTP, hidden 64), few shapes: each new (batch, T) shape
costs an inductor compile (seconds on 2 cores; ~40 s for this file with a cold inductor cache).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch._dynamo.utils import counters

from mlaq.engine.adapter import DeepseekLatentLM
from mlaq.engine.compiled import CompiledLatentLM
from mlaq.engine.llm import LLM
from mlaq.engine.sampling_params import SamplingParams
from mlaq.model import load_model
from mlaq.model.layers.step_pieces import StepPieces
from model_helpers import deepseek_v3_with_mtp, hf_checkpoint

PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [11, 3, 60, 28], [70, 12, 8, 51, 19, 4, 30, 22, 6]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return deepseek_v3_with_mtp(tmp_path_factory.mktemp("ds3"))


def tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [list(o.outputs[0].token_ids) for o in outs]


def assert_greedy_up_to_a_near_tie(llm: LLM, prompts: list[list[int]], want: list[list[int]]) -> None:
    """Each continuation equals ``want`` up to its first difference, and there the two tokens were a near
    tie for ``llm`` (its top two, within 0.05 nats): arithmetic that differs from the reference in the last
    bits of bf16 may flip a tie, never a clear choice; past the flip the two texts are not comparable."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    for out, ref in zip(llm.generate([{"prompt_token_ids": p} for p in prompts], params), want, strict=True):
        got, steps = list(out.outputs[0].token_ids), out.outputs[0].logprobs
        for i, (g, w) in enumerate(zip(got, ref, strict=True)):
            if g != w:
                assert w in steps[i] and steps[i][g] - steps[i][w] < 0.05, (i, g, w, steps[i])
                break


def test_compiled_greedy_equals_eager(checkpoint):
    eager = tokens(LLM(checkpoint, max_model_len=64), PROMPTS)
    counters.clear()
    compiled_llm = LLM(checkpoint, max_model_len=64, compile=True)
    # rows of different lengths: per-row positions, masked padding in the gathered cache
    assert tokens(compiled_llm, PROMPTS) == eager
    # one graph per piece (head, between layers 0 and 1, tail): the pieces never see the growing cache
    assert counters["stats"]["unique_graphs"] == 3
    # the attention between the pieces reads the runner's resident buffer, as eager decode does
    assert compiled_llm.engine.runner.resident is not None
    # freezing / cpp_wrapper apply only while mlaq's compiled steps run: nothing leaks into torch's config
    inductor = torch._inductor.config
    assert not (inductor.freezing or inductor.cpp_wrapper or inductor.emulate_precision_casts)


def test_frozen_graphs_are_not_shared_between_models(checkpoint, tmp_path):
    """compile=True freezes the weights into the graphs: a second model of the same shapes (other
    weights) in the same process must get its own graphs, hence its own eager tokens."""
    first = LLM(checkpoint, max_model_len=64, compile=True)
    assert tokens(first, PROMPTS[:1]) == tokens(LLM(checkpoint, max_model_len=64), PROMPTS[:1])
    del first  # its parameters may be freed; their ids must not let its graphs serve the other model
    hf_checkpoint("deepseek_v3", tmp_path, seed=1, num_hidden_layers=2)
    other = tokens(LLM(tmp_path, max_model_len=64, compile=True), PROMPTS[:1])
    assert other == tokens(LLM(tmp_path, max_model_len=64), PROMPTS[:1])
    assert other != tokens(LLM(checkpoint, max_model_len=64), PROMPTS[:1])  # the models do differ


def test_compiled_speculative_greedy_equals_plain_greedy(checkpoint):
    """Verification (T = k + 1) and MTP steps through the compiled graphs; aot_eager keeps the test
    fast (the same dynamo graphs and dynamic shapes, without inductor's C++ build per shape)."""
    plain = tokens(LLM(checkpoint, max_model_len=64), PROMPTS)
    model = CompiledLatentLM(load_model(checkpoint), backend="aot_eager")
    spec = LLM(model, max_model_len=64, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert tokens(spec, PROMPTS) == plain
    assert spec.spec_decoding_stats is not None and spec.spec_decoding_stats.num_drafts > 0


@pytest.mark.parametrize("top_k", [2, 3])
def test_static_moe_matches_eager_moe(checkpoint, tmp_path, top_k):
    """The routing-independent MoE (gathered and all-expert forms) against MoE.forward; top_k 3 takes
    the sorted-experts branch (with 2 the sum needs no order)."""
    from mlaq.model.layers.step_pieces import _moe

    if top_k != 2:
        hf_checkpoint("deepseek_v3", tmp_path, num_hidden_layers=2, num_experts_per_tok=top_k)
        checkpoint = tmp_path
    model = load_model(checkpoint)
    assert model.config.hf["num_experts_per_tok"] == top_k
    pieces = StepPieces(model)
    layer = 1  # first_k_dense_replace = 1: layer 1 is the MoE
    moe, experts = model.model.layers[layer].mlp, pieces.experts[layer]
    assert experts is not None
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 9):  # n*k < E gathers (n = 1, 2), else every expert runs (n = 9)
        x = torch.randn(1, n, model.config.hidden_size, generator=g)
        torch.testing.assert_close(_moe(moe, experts, x), moe(x), rtol=1e-5, atol=1e-6)
    stacked = moe._live_stack()  # the loader's stacked storage: the static step views it, no copy
    assert stacked is not None
    for mine, theirs in zip((experts.gate, experts.up, experts.down), stacked, strict=True):
        assert mine.data_ptr() == theirs.data_ptr() and mine.numel() == theirs.numel()


def test_compile_refuses_other_models():
    class NotDeepseek:
        pass

    with pytest.raises(ValueError, match="compile=True needs one of mlaq's DeepSeek models"):
        LLM(NotDeepseek(), compile=True, max_model_len=16)  # type: ignore[arg-type]


@pytest.mark.parametrize(("scheme", "folded"), [("fp8_per_tensor", True), ("mxfp8", False)])
def test_compiled_with_a_quantizing_scheme_equals_eager(checkpoint, scheme, folded):
    """A quantizing BMM scheme inside the compiled pieces where it compiles exactly (fp8_per_tensor),
    eagerly beside the attention where it does not (mxfp8); eager's tokens either way (aot_eager:
    graph capture only; tests/test_bmm_compiled.py checks inductor's bits)."""
    qc = json.dumps({"targets": {"re:.*kv_b_proj.*": scheme}})
    eager = tokens(LLM(checkpoint, max_model_len=64, quantization_config=qc), PROMPTS)
    model = CompiledLatentLM(load_model(checkpoint, quantization_config=qc), backend="aot_eager")
    assert [model._pieces.folds(i) for i in range(3)] == [folded] * 3  # 2 layers + MTP
    assert tokens(LLM(model, max_model_len=64), PROMPTS) == eager


def test_compiled_refuses_a_model_prepared_again(checkpoint):
    """The pieces are guarded on their inputs only: BMM weights prepared again (another scheme) after
    they were built must be refused, not run with the old graphs."""
    model = CompiledLatentLM(load_model(checkpoint), backend="aot_eager")
    llm = LLM(model, max_model_len=64)
    tokens(llm, PROMPTS[:1])
    model.model.model.layers[0].self_attn.prepare("mxfp4")
    with pytest.raises(ValueError, match="prepared again after its compiled pieces were built"):
        tokens(llm, PROMPTS[:1])


def test_compiled_batches_that_change_and_rows_that_differ(checkpoint):
    """A batch that shrinks as rows finish (a new batch size: dynamo makes the batch dynamic once)
    and rows at different positions, written into the resident buffer row by row."""
    ragged = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [ragged, GREEDY, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)]
    model = CompiledLatentLM(load_model(checkpoint), backend="aot_eager")
    counters.clear()
    got = [list(o.outputs[0].token_ids) for o in LLM(model, max_model_len=64).generate(prompts, params)]
    want = [list(o.outputs[0].token_ids) for o in LLM(checkpoint, max_model_len=64).generate(prompts, params)]
    assert got == want and [len(t) for t in got] == [12, 8, 3]
    # batch 3, then 2, then 1: a static graph per piece, a dynamic one for any batch size, and one for
    # batch 1 (dynamo specializes sizes of 1), not one per batch size
    assert counters["stats"]["unique_graphs"] <= 3 * 3


def test_compiled_bf16_holds_the_resident_latents_in_bf16(checkpoint):
    """The flash kernel reads the latents in the compute dtype: the runner's buffer holds bf16 (half
    the eager engine's float32 buffer), and decoding over it runs."""
    model = CompiledLatentLM(load_model(checkpoint, dtype=torch.bfloat16), backend="aot_eager")
    llm = LLM(model, max_model_len=64)
    out = tokens(llm, PROMPTS)
    assert [len(t) for t in out] == [8, 8, 8]
    assert llm.engine.runner.resident is not None and llm.engine.runner.resident.dtype == torch.bfloat16
    eager = LLM(checkpoint, max_model_len=64, dtype=torch.bfloat16)
    assert eager.engine.runner.resident is not None and eager.engine.runner.resident.dtype == torch.float32


def test_compiled_pieces_are_guarded_on_their_inputs_only(checkpoint):
    """Dynamo checks a piece's arguments, not the model's tensors (mlaq.engine.compile_regions.inputs_only): a
    weight's metadata changed in a way that leaves every result alone (requires_grad, under no_grad)
    retraces nothing; with dynamo's default guards its TENSOR_MATCH fails and the pieces compile again."""
    model = CompiledLatentLM(load_model(checkpoint), backend="aot_eager")
    llm = LLM(model, max_model_len=64)
    want = tokens(llm, PROMPTS[:1])
    counters.clear()
    for layer in model.model.model.layers:
        layer.self_attn.o_proj.weight.requires_grad_(True)
    assert tokens(llm, PROMPTS[:1]) == want
    assert counters["stats"]["unique_graphs"] == 0


def test_module_globals_the_pieces_read_are_not_guarded(checkpoint, monkeypatch):
    """Nor the identity of the module functions the pieces call (checked on every call by default): a
    function rebound after the pieces compiled is not seen by them, and nothing recompiles."""
    from mlaq.model.layers import mla

    model = CompiledLatentLM(load_model(checkpoint), backend="aot_eager")
    llm = LLM(model, max_model_len=64)
    want = tokens(llm, PROMPTS[:1])
    counters.clear()
    real = mla.rotate
    monkeypatch.setattr(mla, "rotate", lambda *a, **k: real(*a, **k))
    assert tokens(llm, PROMPTS[:1]) == want
    assert counters["stats"]["unique_graphs"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_attention_kernels_give_eager_tokens(checkpoint, monkeypatch, dtype):
    """``attention="mlaq"`` (mlaq's C kernel: decode, verification and a lone prompt's causal prefill;
    in bf16 also the ``bf16`` scheme's two BMMs) and ``attention="torch"`` (torch's fused kernel): eager's
    greedy tokens, plain and with MTP, one prompt and three of different lengths."""
    from mlaq.model.kernels.mla_kernel import MlaKernel

    calls: list[str] = []
    for name in ("attend", "prefill", "absorb", "up"):
        real = getattr(MlaKernel, name)
        monkeypatch.setattr(
            MlaKernel, name, lambda self, *a, _r=real, _n=name: calls.append(_n) or _r(self, *a)
        )

    def loaded():
        model = load_model(checkpoint, dtype=dtype)
        if dtype == torch.bfloat16:  # the bf16 scheme (a bf16 checkpoint's default; this one is fp32)
            for layer in model.model.layers:
                layer.self_attn.prepare("bf16")
        return model

    spec = {"method": "mtp", "num_speculative_tokens": 2}
    eager = LLM(DeepseekLatentLM(loaded()), max_model_len=64)
    for attention in ("mlaq", "torch"):
        calls.clear()
        model = CompiledLatentLM(loaded(), backend="aot_eager", attention=attention)
        assert (model.kernel is not None) == (attention == "mlaq")
        for prompts in (PROMPTS[:1], PROMPTS):
            want = tokens(eager, prompts)
            for llm in (LLM(model, max_model_len=64), LLM(model, max_model_len=64, speculative_config=spec)):
                if attention == "mlaq" or dtype == torch.float32:
                    assert tokens(llm, prompts) == want
                else:  # torch's bf16 flash kernel rounds the probabilities before the value sum (mla_flash)
                    assert_greedy_up_to_a_near_tie(llm, prompts, want)
        assert ({"attend", "prefill"} <= set(calls)) == (attention == "mlaq")
        assert ({"absorb", "up"} <= set(calls)) == (attention == "mlaq" and dtype == torch.bfloat16)


def test_max_autotune_gives_eager_tokens_and_touches_torch_only_during_a_step(checkpoint):
    """vLLM's ``compilation_config={"inductor_compile_config": {"max_autotune": True}}``: inductor times its
    C++ GEMM templates against oneDNN for each linear and keeps the faster; tokens stay eager's, and
    the setting is in force only while a step's pieces run."""
    config = {"inductor_compile_config": {"max_autotune": True}}
    seen: list[bool] = []
    real = StepPieces.head
    StepPieces.head = lambda self, *a: seen.append(torch._inductor.config.max_autotune) or real(self, *a)
    try:  # the pieces are bound when the model is built: patch first
        llm = LLM(checkpoint, max_model_len=64, compile=True, compilation_config=json.dumps(config))
        got = tokens(llm, PROMPTS[:1])
    finally:
        StepPieces.head = real
    assert seen and all(seen)  # traced under max_autotune
    assert not torch._inductor.config.max_autotune
    assert got == tokens(LLM(checkpoint, max_model_len=64), PROMPTS[:1])


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('{"inductor_compile_config": {"max_autotune": 1}}', "max_autotune must be true or false"),
        ('{"level": 3}', r"unsupported compilation_config key\(s\) \['level'\]"),
        ('{"inductor_compile_config": {"freezing": false}}', "inductor_compile_config.freezing"),
        ('{"inductor_compile_config": true}', "inductor_compile_config must be an object"),
        ("[1]", "must be a JSON object"),
        ("{max_autotune}", "not valid JSON"),
    ],
)
def test_compilation_config_refuses_what_it_cannot_honour(checkpoint, config, message):
    with pytest.raises(ValueError, match=message):
        LLM(checkpoint, max_model_len=64, compile=True, compilation_config=config)


def test_compilation_config_without_compile_is_an_error(checkpoint):
    with pytest.raises(ValueError, match="applies to compile=True"):
        LLM(checkpoint, max_model_len=64, compilation_config={"inductor_compile_config": {}})
    ready = CompiledLatentLM(load_model(checkpoint), backend="aot_eager")
    with pytest.raises(ValueError, match="compiled already"):
        LLM(ready, compile=True, compilation_config={"inductor_compile_config": {"max_autotune": True}})


def test_pieces_fuse_vllms_linears_without_copying(checkpoint):
    """vLLM's fused_qkv_a_proj and gate_up_proj in the pieces: every layer (dense, MoE's shared experts, MTP)
    stacks its pairs once, the model's weights become views of them, and the projections and MLPs give the
    separate layers' bits."""
    model = load_model(checkpoint, dtype=torch.bfloat16)
    layers = model.model.layers
    g = torch.Generator().manual_seed(0)
    hidden = [torch.randn(1, 3, model.config.hidden_size, generator=g).bfloat16() for _ in layers]
    positions = torch.arange(3)[None]
    apart = [layer.self_attn.project(x, positions) for layer, x in zip(layers, hidden, strict=True)]
    mlps = [
        layer.mlp.shared_experts if layer.mlp.__class__.__name__ == "MoE" else layer.mlp for layer in layers
    ]
    mlp_apart = [mlp(x) for mlp, x in zip(mlps, hidden, strict=True)]
    pieces = StepPieces(model)
    assert len(pieces.fused) == len(layers) == 3  # 1 dense + 1 MoE + MTP
    for i, (layer, fused) in enumerate(zip(layers, pieces.fused, strict=True)):
        attn = layer.self_attn
        assert fused.qkv_a is not None and fused.gate_up is not None
        assert attn.q_a_proj.weight.data_ptr() == fused.qkv_a.data_ptr()
        assert attn.kv_a_proj_with_mqa.weight.data_ptr() == fused.qkv_a[attn.config.q_lora_rank :].data_ptr()
        assert mlps[i].gate_proj.weight.data_ptr() == fused.gate_up.data_ptr()
        got = attn.project(hidden[i], positions, qkv_a=fused.qkv_a)
        for name in ("q_nope", "q_pe", "latent", "q_latent"):
            assert torch.equal(getattr(got, name), getattr(apart[i], name)), (i, name)
        assert torch.equal(mlps[i](hidden[i], fused.gate_up), mlp_apart[i])


def test_fused_gate_up_keeps_eagers_bits_in_the_pieces():
    """Inside the compiled pieces an MLP on gate_up gives eager's bits: SiLU reads the GEMM's bf16 output (as
    separate GEMMs, inductor fused SiLU into oneDNN's gate GEMM, applied to the float32 sum before rounding)."""
    from mlaq.engine.compile_regions import Settings, compiled_region
    from mlaq.model.layers.linear import fuse_rows
    from mlaq.model.layers.moe import DenseMLP

    torch.manual_seed(0)
    mlp = DenseMLP(64, 96, dtype=torch.bfloat16)
    for p in mlp.parameters():
        p.requires_grad_(False).mul_(8)  # sums of a few units: SiLU's curve, not its linear part
    gate_up = fuse_rows(mlp.gate_proj, mlp.up_proj)
    fn = compiled_region(lambda x: mlp(x, gate_up), "inductor")
    for rows in (1, 3):
        x = torch.randn(1, rows, 64).bfloat16()
        with torch.no_grad(), Settings("inductor"):
            got = fn(x)
        assert torch.equal(got, mlp(x)), rows

"""The runner's resident latents (mlaq.engine.resident): kept between decode steps, rebuilt when they
cannot serve a call, and the engine's outputs bit for bit those of gathering the pages every call."""

from __future__ import annotations

import random

import pytest
import torch

from mlaq.engine.llm import LLM
from mlaq.engine.resident import GROWTH_MIN, ResidentLatents
from mlaq.engine.sampling_params import SamplingParams

pytest.importorskip("transformers")
from model_helpers import deepseek_v3_with_mtp


class Gather:
    """A stand-in for the paged cache's gather: (layers, B, max(starts), E), counting calls."""

    def __init__(self, starts: list[int], layers: int = 2, width: int = 3) -> None:
        self.calls = 0
        self.past = torch.randn(layers, len(starts), max(starts), width)
        for row, s in enumerate(starts):
            self.past[:, row, s:] = 0  # zeros past each row's length, as the engine's gather

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        return self.past


def test_kept_while_the_batch_continues_and_rebuilt_otherwise():
    res, gather = ResidentLatents(), Gather([5, 3])
    buf = res.buffer(["a", "b"], [5, 3], 1, gather)
    assert gather.calls == 1 and buf.shape[2] == 6 + GROWTH_MIN
    assert torch.equal(buf[:, :, :5], gather.past) and not buf[:, :, 5:].any()
    res.written([6, 4])
    assert res.buffer(["a", "b"], [6, 4], 1, gather) is buf and gather.calls == 1  # continues: kept
    res.written([7, 5])
    assert res.buffer(["a", "b"], [6, 5], 3, gather) is buf  # an earlier start overwrites: kept
    res.written([9, 8])
    for ids, starts, t in [
        (["b", "a"], [8, 9], 1),  # another batch order
        (["a", "c"], [9, 8], 1),  # another sequence
        (["a", "b"], [10, 8], 1),  # a row past what the buffer holds for it
        (["a", "b"], [9, 8], 70 - 9 + 1),  # no room left
    ]:
        res, gather = ResidentLatents(), Gather([5, 3])
        held = res.buffer(["a", "b"], [5, 3], 1, gather)
        res.written([9, 8])
        assert res.buffer(["a", "b"], [9, 8], 70 - 9, gather) is held  # just fits: kept
        assert res.buffer(ids, starts, t, gather) is not held and gather.calls == 2, (ids, starts, t)
    kept = res.buffer(["a", "b"], [9, 8], 1, gather)
    res.clear()  # after a prefill
    assert res.buffer(["a", "b"], [9, 8], 1, gather) is not kept and gather.calls == 3  # rebuilt


def test_a_failed_gather_leaves_no_stale_buffer():
    res, gather = ResidentLatents(), Gather([4])
    res.buffer(["a"], [4], 1, gather)

    def broken():
        raise RuntimeError("gather failed")

    with pytest.raises(RuntimeError):
        res.buffer(["b"], [4], 1, broken)
    assert res.buffer(["a"], [4], 1, gather) is not None and gather.calls == 2  # rebuilt, not reused


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return deepseek_v3_with_mtp(tmp_path_factory.mktemp("deepseek_v3"))


def run(path, dtype: torch.dtype, *, resident: bool, k: int = 0, **config) -> tuple[list, int]:
    """Greedy tokens and top-5 logprobs of prompts of several lengths; the gathers of main layers.
    A bf16 model's buffer is held in bf16 here: float32 changes the value matmul's summation order on
    CPUs with a native bf16 GEMM (test_mla_blocked), so only bf16 compares bit for bit."""
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    llm = LLM(path, dtype=dtype, speculative_config=spec, max_model_len=96, block_size=4, **config)
    runner = llm.engine.runner
    assert runner.resident is not None  # a bf16/fp32 cache without indexer columns: resident
    runner.resident = ResidentLatents(dtype) if resident else None
    gathers = 0
    gather_layers = runner.cache.gather_layers

    def counted(*args):
        nonlocal gathers
        gathers += 1
        return gather_layers(*args)

    runner.cache.gather_layers = counted
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 90) for _ in range(n)]} for n in (9, 1, 23, 4, 15)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], gathers


@pytest.mark.parametrize(
    "k, config",
    [(0, {}), (2, {}), (0, {"max_num_seqs": 2}), (2, {"max_num_seqs": 3, "num_kv_blocks": 14})],
    ids=["plain", "mtp", "staggered", "preempted"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_bit_identical_to_gathering_every_call(checkpoint, k, config, dtype):
    kept, kept_gathers = run(checkpoint, dtype, resident=True, k=k, **config)
    gathered, all_gathers = run(checkpoint, dtype, resident=False, k=k, **config)
    assert kept == gathered  # tokens and their logprobs, exactly
    assert kept_gathers < all_gathers / 2  # most decode calls read the resident buffer


def test_float32_buffer_of_a_bf16_model_changes_only_the_value_matmuls_order(checkpoint):
    """The default buffer (float32) under a bf16 model: the float32 value GEMM instead of a native bf16
    one, the same sums in another order: chosen-token logprobs agree to a bf16 rounding step."""
    llm = LLM(checkpoint, dtype=torch.bfloat16, max_model_len=96, block_size=4)
    assert llm.engine.runner.resident.dtype == torch.float32
    rng = random.Random(4)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 90) for _ in range(n)]} for n in (9, 1, 23)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    kept = llm.generate(prompts, params)
    llm.engine.runner.resident = None
    gathered = llm.generate(prompts, params)
    for a, b in zip(kept, gathered, strict=True):
        n = next(
            (
                i
                for i, (x, y) in enumerate(zip(a.outputs[0].token_ids, b.outputs[0].token_ids, strict=True))
                if x != y
            ),
            12,
        )
        for i in range(n):  # up to a first difference (a near tie), the same tokens' logprobs
            (lp_a,), (lp_b,) = a.outputs[0].logprobs[i].values(), b.outputs[0].logprobs[i].values()
            assert abs(lp_a - lp_b) <= 0.05
        assert n >= 4


def test_an_idle_engine_holds_no_buffer(checkpoint):
    llm = LLM(checkpoint, max_model_len=96, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    held = []
    for _ in llm.generate_stream([{"prompt_token_ids": [5, 9, 2]}, {"prompt_token_ids": [7] * 11}], params):
        held.append(llm.engine.runner.resident._batch is not None)
    assert any(held)  # decoding kept it
    assert llm.engine.runner.resident._batch is None  # released once every request finished
    rid = llm.engine.add_request([3, 4, 5], params)
    llm.engine.step()  # prefill
    llm.engine.step()  # a decode step builds it
    assert llm.engine.runner.resident._batch is not None
    assert llm.engine.abort(rid) and llm.engine.runner.resident._batch is None


def test_a_failed_call_drops_the_buffer(checkpoint):
    llm = LLM(checkpoint, max_model_len=96, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.engine.add_request([3, 4, 5, 6], params)
    llm.engine.step()  # prefill
    llm.engine.step()  # decode: the buffer is built
    runner = llm.engine.runner
    assert runner.resident._batch is not None
    forward = runner.model.forward

    def failing(*args, **kwargs):
        forward(*args, **kwargs)  # the layers write into the buffer, then the call fails
        raise RuntimeError("interrupted")

    runner.model.forward = failing
    with pytest.raises(RuntimeError, match="interrupted"):
        llm.engine.step()
    assert runner.resident._batch is None

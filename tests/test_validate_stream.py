"""``mlaq validate --stream``: the layer-streamed source gives in-memory validate's numbers (per-layer
attention error, KL / top-1 / ΔNLL, per-op BMM error) on models that fit, reads each layer and each
routed expert once, plans within its budget, and fails cleanly (budget, missing shard, Ctrl-C)."""

from __future__ import annotations

import dataclasses
import math
import shutil

import pytest
import torch

from mlaq.progress import NullProgress

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from mlaq.cli import main
from mlaq.model import Precision
from mlaq.validate.config import NOISE_FLOOR, REFERENCE, ValidateConfig, Variant, VariantKind
from mlaq.validate.record import Record
from mlaq.validate.runner import measure
from mlaq.validate.sources.engine import EngineSource
from mlaq.validate.sources.stream import StreamSource
from mlaq.validate.stream import StreamConfig, parse_size
from mlaq.validate.tasks.spec import TaskConfig
from quant_helpers import quantize_checkpoint
from validate_helpers import local_config, reshaped, tiny_checkpoint

SMALL = {
    "flip_rows": 32,  # of the window's 64 query rows: a sample, as validate's default takes of long windows
    "context_len": 64,
    "windows": 2,
    "buckets": 4,
    "prompts": 1,
    "prompt_len": 16,
    "max_tokens": 2,
    "num_speculative_tokens": 0,
}
TASKS = TaskConfig(tasks=("needle", "vartrack"), lengths=(224, 256), samples=2)
FP32 = Variant("fp32", VariantKind.REFERENCE, torch.float32, "fp32")
BUDGET = 8 * 2**30


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("stream_v3"))


class _Steps(NullProgress):
    def __init__(self) -> None:
        self.total, self.lines = 0, []

    def begin(self, total: int) -> None:
        self.total = total

    def step(self, description: str) -> None:
        self.lines.append(description)


def _config(path, schemes=("fp8_per_tensor", "mxfp4"), **kw) -> ValidateConfig:
    return local_config(path, schemes=schemes, **{**SMALL, **kw})


def _both(cfg, reference=REFERENCE, noise_floor=NOISE_FLOOR, max_chunk=None) -> tuple[Record, Record]:
    engine = measure(cfg, source=EngineSource(cfg, reference=reference, noise_floor=noise_floor))
    stream = StreamSource(cfg, StreamConfig(BUDGET, max_chunk), reference=reference, noise_floor=noise_floor)
    return engine, measure(cfg, source=stream)


def _assert_same(engine: Record, stream: Record, rel: float = 1e-6) -> None:
    """Every per-window, per-bucket sum of every quantity, every per-op error and the operand
    statistics agree to ``rel`` relative (of the quantity's largest value)."""
    variants = [(engine.reference, stream.reference), *zip(engine.candidates, stream.candidates, strict=True)]
    if engine.noise_floor is not None:
        variants.append((engine.noise_floor, stream.noise_floor))
    for a, b in variants:
        assert (a.name, a.layers) == (b.name, b.layers)
        assert set(a.positions) == set(b.positions), a.name
        assert a.schemes == b.schemes
        for q, ta in a.positions.items():
            tb = b.positions[q]
            assert ta.counts == tb.counts, (a.name, q)
            flat_a = [x for row in ta.sums for x in row]
            flat_b = [x for row in tb.sums for x in row]
            scale = max(abs(x) for x in flat_a) or 1.0
            worst = max(abs(x - y) for x, y in zip(flat_a, flat_b, strict=True)) / scale
            assert worst <= rel, (a.name, q, worst)
        assert len(a.tasks) == len(b.tasks), a.name
        for x, y in zip(a.tasks, b.tasks, strict=True):
            assert (x.correct, x.token_accuracy) == (y.correct, y.token_accuracy), a.name
            assert math.isclose(x.logprob, y.logprob, rel_tol=rel), (a.name, x.logprob, y.logprob)
        assert [o.layer for o in a.ops] == [o.layer for o in b.ops]
        for oa, ob in zip(a.ops, b.ops, strict=True):
            for f in ("weight_uk", "weight_uv", "bmm_uk", "bmm_uv"):
                x, y = getattr(oa, f), getattr(ob, f)
                assert math.isclose(x, y, rel_tol=rel, abs_tol=1e-12), (a.name, oa.layer, f, x, y)
    assert engine.operands.keys() == stream.operands.keys()
    assert (engine.tasks is None) == (stream.tasks is None)
    if engine.tasks is not None:
        assert engine.tasks.samples == stream.tasks.samples and engine.tasks.config == stream.tasks.config


def test_streamed_equals_in_memory_in_fp32(checkpoint) -> None:
    """The issue's check: identical per-layer errors, KL, attention flips and task scores to 1e-6
    relative, fp32 reference."""
    engine, stream = _both(_config(checkpoint, tasks=TASKS), reference=FP32, noise_floor=None)
    _assert_same(engine, stream)
    assert len(stream.reference.tasks) == len(stream.tasks.samples) == 8
    logprobs = [
        (a.logprob, b.logprob)
        for a, b in zip(stream.reference.tasks, stream.candidates[1].tasks, strict=True)
    ]
    assert any(a != b for a, b in logprobs)  # mxfp4 moves the answers' log-probabilities
    for q in ("kl", "flip/1", "tv/1"):  # mxfp4 moves them: the comparison is not vacuous
        assert sum(map(sum, stream.candidates[1].positions[q].sums)) > 0, q
    assert "flip/2" in stream.candidates[1].positions  # the MTP layer's flips too
    assert [x.layer for x in stream.candidates[0].layers] == [0, 1, 2]  # the MTP layer (2) included
    assert stream.reference.generation is None  # teacher-forced only


def test_streamed_equals_in_memory_bf16_with_noise_floor_and_as_configured(checkpoint) -> None:
    """Default variants (bf16 reference, fp32 noise floor: two compute dtypes streamed side by side)
    and --as-configured through the policy."""
    cfg = _config(
        checkpoint, as_configured=True, quantization_config='{"targets": {"re:.*kv_b_proj": "mxfp4"}}'
    )  # consistent: the naive path (the task prefills) runs each scheme's own weights
    cfg = reshaped(cfg, tasks=TASKS, precision=Precision.CONSISTENT)
    engine, stream = _both(cfg)
    _assert_same(engine, stream)
    assert stream.candidates[-1].decisions == engine.candidates[-1].decisions != []
    info = stream.config["stream"]
    assert "not run" in info["generation"] and stream.config["num_speculative_tokens"] == 0
    assert info["peak_rss_bytes"] > 0 and info["within_budget"]


def test_dsa_and_chunked_attention(tmp_path) -> None:
    """glm_moe_dsa: the indexer's top-k selection runs per layer (full and shared layers); a plan of
    16 query rows per call (the chunked path a small budget picks) still gives the same numbers, the
    task samples' tails attending over their prefilled prefix (and its indexer keys) in chunks too."""
    ckpt = tiny_checkpoint(tmp_path / "dsa", "glm_moe_dsa")
    cfg = _config(ckpt, schemes=("mxfp4",), windows=1, tasks=TaskConfig(("needle",), (224,), 2))
    engine, stream = _both(cfg, max_chunk=16)
    assert stream.config["stream"]["plan"]["attention_chunk"] == 16
    # chunked matmuls may round differently from whole-window ones (it has matched exactly here)
    _assert_same(engine, stream, rel=1e-4)
    assert stream.candidates[0].layers and stream.candidates[0].positions["attn_diff2/1"]


def test_fp8_block_checkpoint(tmp_path) -> None:
    """A DeepSeek-style FP8 checkpoint (e4m3 + 128x128 weight_scale_inv): read as stored, dequantized
    per expert / per tensor exactly as the loader does; as-configured runs kv_b_proj from its codes."""
    ckpt = tiny_checkpoint(tmp_path / "fp8")
    quantize_checkpoint(ckpt, "fp8")
    cfg = _config(ckpt, schemes=("mxfp4",), as_configured=True)
    engine, stream = _both(cfg, reference=FP32, noise_floor=None)
    _assert_same(engine, stream)


def test_each_layer_and_expert_is_read_once(checkpoint) -> None:
    """Bytes read = every tensor of every layer once (routed experts at most once per layer), the
    embedding rows the windows use, the final norm and the head; never the MTP's head or embedding."""
    cfg = _config(checkpoint)
    steps = _Steps()
    stream = measure(cfg, source=StreamSource(cfg, StreamConfig(BUDGET)), progress=steps)
    info = stream.config["stream"]
    # validate's one progress: a step per decoder layer stage (read, attention, MLP), the head and the MTP
    # layer, each naming the bytes read so far, the ETA they give and the peak RSS
    assert len(steps.lines) == steps.total == 2 * 3 + 1 + 1, steps.lines
    assert steps.lines[0].startswith("layer 0: reading (") and steps.lines[-2].startswith("final norm")
    assert all(" read, ETA " in line and ", peak RSS " in line for line in steps.lines)
    sizes = {f.name: f.stat().st_size for f in checkpoint.glob("*.safetensors")}
    assert 0 < info["bytes_read"] < sum(sizes.values())
    layers = [x for x in info["layers"] if x["layer"] >= 0]
    assert [x["layer"] for x in layers] == [0, 1, 2]
    assert layers[0]["experts_read"] == 0  # first_k_dense_replace: a dense MLP
    assert 0 < layers[1]["experts_read"] <= 8 and 0 < layers[2]["experts_read"] <= 8


def test_budget_too_small_names_the_size(checkpoint) -> None:
    cfg = _config(checkpoint)
    with pytest.raises(ValueError, match=r"--memory-budget 1 MiB is too small: .* needs at least .*GiB"):
        measure(cfg, source=StreamSource(cfg, StreamConfig.parse("1MiB")))


@pytest.mark.parametrize(
    ("text", "value"),
    [("8GiB", 8 * 2**30), ("2GB", 2 * 10**9), ("512MiB", 512 * 2**20), ("1.5G", 3 * 2**29), ("4096", 4096)],
)
def test_parse_size(text, value) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "8 parsecs", "-1GiB", "0"])
def test_parse_size_rejects(text) -> None:
    with pytest.raises(ValueError, match="--memory-budget"):
        parse_size(text)


def _cli(ckpt, out, *extra):
    args = ["validate", str(ckpt), "--stream", "--context-len", "64", "--windows", "1", "--schemes", "mxfp4"]
    return main([*args, "--no-progress", "--out", str(out), *extra])


def test_cli_stream_writes_the_report(checkpoint, tmp_path, capsys) -> None:
    assert _cli(checkpoint, tmp_path / "r", "--memory-budget", "4GiB") == 0
    md = (tmp_path / "r" / "report.md").read_text()
    assert "## Layer streaming" in md and "Free generation and MTP acceptance**: not run" in md
    assert "layer-streamed (teacher-forced only" in capsys.readouterr().out.replace("\n", " ").replace(
        "  ", " "
    )


def test_memory_budget_needs_stream(checkpoint, capsys) -> None:
    assert main(["validate", str(checkpoint), "--memory-budget", "2GiB"]) == 2
    assert "--memory-budget applies to --stream" in capsys.readouterr().err


def test_shard_missing_mid_run_leaves_the_previous_report(checkpoint, tmp_path, monkeypatch, capsys) -> None:
    """A shard deleted after the run started: one clear line naming it, exit != 0, report untouched."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    out = tmp_path / "r"
    assert _cli(ckpt, out) == 0
    before = (out / "report.json").read_bytes()
    from mlaq.model.loading.layer_source import LayerSource

    real = LayerSource.layer

    def layer(self, index, dtypes):
        if index == 1:  # the run has started: remove the shard holding this layer's first tensor
            self.reader.file_of(f"model.layers.{index}.input_layernorm.weight").unlink()
        return real(self, index, dtypes)

    monkeypatch.setattr(LayerSource, "layer", layer)
    capsys.readouterr()
    assert _cli(ckpt, out) == 2
    err = capsys.readouterr().err
    assert "is missing: it was there when the run started" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert (out / "report.json").read_bytes() == before


def test_ctrl_c_is_a_clean_stop(checkpoint, tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / "r"
    assert _cli(checkpoint, out) == 0
    before = (out / "report.json").read_bytes()
    from mlaq.model.loading.layer_source import LayerSource

    def interrupted(self, index, dtypes):
        raise KeyboardInterrupt

    monkeypatch.setattr(LayerSource, "layer", interrupted)
    capsys.readouterr()
    assert _cli(checkpoint, out) == 130
    err = capsys.readouterr().err
    assert (
        err.strip() == "mlaq validate: interrupted; nothing was written (a previous report stays as it was)"
    )
    assert (out / "report.json").read_bytes() == before


_FRAGMENT = """
import sys, torch
from mlaq.libc import return_freed_memory
from mlaq.validate.stream.budget import current_rss
if sys.argv[1] == "fixed":
    assert return_freed_memory()
big = torch.ones(2**22)  # 16 MiB: mapped; once freed, glibc raises its mmap threshold to 16 MiB
del big
base = current_rss()
held = [torch.ones(2**21) for _ in range(24)]  # 24 x 8 MiB: from the heap once the threshold rose
del held[:-1]  # the last one stays: the heap's top cannot be trimmed
print((current_rss() - base) / 2**20)
"""


@pytest.mark.parametrize(("mode", "resident"), [("default", True), ("fixed", False)])
def test_freed_buffers_go_back_to_the_os(mode, resident) -> None:
    """The fragmentation that held a layer's worth of freed memory in a streamed run: by default glibc
    keeps 23 freed 8 MiB buffers resident; with the fixed mmap threshold only the live one stays."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _FRAGMENT, mode], capture_output=True, text=True, check=True)
    grown_mib = float(run.stdout.strip())
    assert (grown_mib > 150) is resident, grown_mib


def test_plan_counts_the_task_suite() -> None:
    """DeepSeek-V3 attention shapes: the suite's hidden states raise the planned peak, and a budget they
    do not fit names the size needed and the flags that shrink the suite."""
    from mlaq.validate.stream.budget import Shape, plan

    base = Shape(7168, 128, 128, 64, 512, 128, 129280, tokens=128, windows=1, stream_bytes=(2, 2), variants=2)
    suite = dataclasses.replace(base, task_tokens=8192, task_len=4096, task_batch=1, task_hidden=8192 * 2 * 3)
    args = (2**30, 2**29, 2**28, 2**28)  # baseline, layer, expert and head bytes
    without, with_tasks = plan(base, 8 * 2**30, *args), plan(suite, 8 * 2**30, *args)
    assert with_tasks.estimate - without.estimate >= 2 * 7168 * 8192 * 2 * 3
    with pytest.raises(ValueError, match=r"too small: .* needs at least .*--tasks none"):
        plan(suite, 2 * 2**30, *args)

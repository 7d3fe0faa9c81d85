"""mlaq audit on small real-layout checkpoints: figures pinned to mlaq.bmm computed directly on the same
weights, and proof that no byte outside kv_b_proj (and its scales, and the headers) is read."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from safetensors import safe_open

from audit_helpers import bf16_checkpoint, header_ranges, header_spans
from mlaq.audit import RangeReader, audit, suggest_config
from mlaq.bmm import get_scheme, split_kv_b_proj
from mlaq.settings import Settings
from quant_helpers import quantize_checkpoint

OFF = Settings(fp8bmm=False, fp4bmm=False)
N, P, V = 2, 128, 128  # the helper model: 2 heads, DeepSeek-V3's P and V
SCHEMES = ("fp8_per_tensor", "fp8_per_block", "mxfp4", "mxfp8")


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return bf16_checkpoint(tmp_path_factory.mktemp("audit") / "bf16")


@pytest.fixture(scope="module")
def fp8(bf16, tmp_path_factory):
    dst = tmp_path_factory.mktemp("audit") / "fp8"
    shutil.copytree(bf16, dst)
    exact = quantize_checkpoint(dst, "fp8")  # independent quantizer (ml_dtypes), exact dequantized values
    return dst, exact


def _kv_b(path, layer):
    spans = header_spans(path)
    name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
    with safe_open(str(spans[name][0]), "pt") as f:
        return f.get_tensor(name)


def _direct(weight: torch.Tensor, scheme: str) -> tuple[tuple[float, float], tuple[float, float]]:
    """(rel RMS, max abs) of W_UK and W_UV^T under ``scheme``, float64, straight from mlaq.bmm."""
    out = []
    for half in split_kv_b_proj(weight.double().float(), N, P, V):
        q = get_scheme(scheme).prepare(half).dequantize(torch.float64)
        ref = half.double()
        out.append((float((q - ref).norm() / ref.norm()), float((q - ref).abs().max())))
    return out[0], out[1]


def test_bf16_figures_match_bmm_directly(bf16):
    r = audit(bf16, SCHEMES, OFF)
    assert [layer["layer"] for layer in r["layers"]] == [0, 1, 2, 3]  # MTP layer 3 included
    assert r["layers"][3]["mtp"] and not r["layers"][2]["mtp"]
    for layer in r["layers"]:
        w = _kv_b(bf16, layer["layer"])
        for s in SCHEMES:
            got = layer["schemes"][s]
            assert not got["uses_checkpoint_data"]
            for half, (rel, mx) in zip(("w_uk", "w_uv"), _direct(w, s), strict=True):
                assert math.isclose(got[half]["rel_rms"], rel, rel_tol=1e-5), (layer["layer"], s, half)
                assert math.isclose(got[half]["max_abs"], mx, rel_tol=1e-6), (layer["layer"], s, half)
                assert got[half]["rel_rms"] > 0.005  # the quantization really happened
    # ranking: riskiest first under the first scheme
    risks = [
        max(r["layers"][i]["schemes"]["fp8_per_tensor"][h]["rel_rms"] for h in ("w_uk", "w_uv"))
        for i in r["ranking"]
    ]
    assert risks == sorted(risks, reverse=True)


def test_fp8_checkpoint_is_dequantized_with_its_scales_first(fp8):
    path, exact = fp8
    r = audit(path, ("fp8_per_block", "mxfp4", "bf16"), OFF)
    for layer in r["layers"]:
        stored = layer["schemes"]["fp8_per_block"]
        assert layer["stored"] == "fp8_per_block" and stored["uses_checkpoint_data"]
        assert stored["w_uk"]["rel_rms"] == 0.0 and stored["w_uv"]["max_abs"] == 0.0  # runs as stored
        assert layer["policy"]["rule"] == "checkpoint"
        ref = exact[f"model.layers.{layer['layer']}.self_attn.kv_b_proj.weight"]  # ml_dtypes' dequantization
        for s in ("mxfp4", "bf16"):
            for half, (rel, mx) in zip(("w_uk", "w_uv"), _direct(ref, s), strict=True):
                assert math.isclose(layer["schemes"][s][half]["rel_rms"], rel, rel_tol=1e-5), (s, half)
                assert math.isclose(layer["schemes"][s][half]["max_abs"], mx, rel_tol=1e-6), (s, half)


def test_statistics_pinned(bf16):
    r = audit(bf16, ("mxfp4",), OFF)
    layer = r["layers"][1]
    w_uk, w_uv = split_kv_b_proj(_kv_b(bf16, 1).float(), N, P, V)
    c = w_uv.double() - w_uv.double().mean()
    kurt = float((c**4).mean() / (c**2).mean() ** 2 - 3)
    assert math.isclose(layer["w_uv"]["kurtosis"], kurt, rel_tol=1e-4, abs_tol=1e-4)
    amax = w_uk.abs().amax(dim=(1, 2))
    assert layer["w_uk"]["head_amax_spread"] == pytest.approx(float(amax.max() / amax.min()))
    # MX blocks: 32 along K; a block saturates when an element exceeds 6 x its E8M0 scale
    mx = get_scheme("mxfp4").prepare(w_uk)
    scale = torch.exp2(mx.mx.scales.double() - 127).repeat_interleave(32, dim=1)  # (N, P, L)
    src = w_uk.to(torch.bfloat16).double()
    sat = (src.abs() > 6 * scale).reshape(N, P // 32, 32, -1).any(2).double().mean()
    q = mx.dequantize(torch.float64)
    flush = ((src != 0) & (q == 0)).reshape(N, P // 32, 32, -1).any(2).double().mean()
    e = layer["schemes"]["mxfp4"]["w_uk"]
    assert e["mx_saturate_blocks"] == pytest.approx(float(sat)) and e["mx_flush_blocks"] == pytest.approx(
        float(flush)
    )
    assert e["predicted_bmm"] == pytest.approx(math.sqrt(e["rel_rms"] ** 2 + 0.1119**2 + 0.0017**2))


class GuardedReader(RangeReader):
    """A reader that fails on any byte range but the headers and the kv_b_proj tensors (with scales)."""

    def __init__(self, allowed):
        super().__init__()
        self.allowed = allowed
        self.ranges = []

    def pread(self, file, offset, length):
        rng = (file, offset, offset + length)
        if rng not in self.allowed:
            raise AssertionError(f"read outside kv_b_proj: {file.name} bytes {offset}..{offset + length}")
        self.ranges.append(rng)
        return super().pread(file, offset, length)


@pytest.mark.parametrize("which", ["bf16", "fp8"])
def test_reads_only_kv_b_proj(which, bf16, fp8, monkeypatch):
    path = bf16 if which == "bf16" else fp8[0]
    spans = header_spans(path)
    kv_b = {rng for name, rng in spans.items() if ".self_attn.kv_b_proj." in name}
    assert len(kv_b) == (4 if which == "bf16" else 8)  # weight (+ weight_scale_inv) of 4 layers
    reader = GuardedReader(kv_b | header_ranges(path))
    import safetensors

    def forbidden(*a, **k):
        raise AssertionError("safetensors was opened")

    monkeypatch.setattr(safetensors, "safe_open", forbidden)
    r = audit(path, ("fp8_per_tensor", "mxfp4"), OFF, reader=reader)
    assert {rng for rng in reader.ranges if rng in kv_b} == kv_b  # each read exactly once
    assert len([rng for rng in reader.ranges if rng in kv_b]) == len(kv_b)
    assert r["io"]["bytes_read"] == sum(b - a for _, a, b in reader.ranges)
    assert r["io"]["kv_b_weight_bytes"] + r["io"]["scale_bytes"] == sum(b - a for _, a, b in kv_b)


def test_guard_catches_a_stray_read(bf16):
    """The guard can fail: a reader asked for another tensor trips it."""
    spans = header_spans(bf16)
    reader = GuardedReader(header_ranges(bf16))
    from mlaq.audit import RangeCheckpoint

    ckpt = RangeCheckpoint(bf16, reader)
    with pytest.raises(AssertionError, match="read outside kv_b_proj"):
        ckpt.get("model.layers.0.self_attn.o_proj.weight")
    assert "model.layers.0.self_attn.o_proj.weight" in spans


def test_suggest_config_splits_at_the_threshold(bf16):
    r = audit(bf16, ("mxfp4",), OFF)
    risks = sorted(
        max(layer["schemes"]["mxfp4"][h]["rel_rms"] for h in ("w_uk", "w_uv")) for layer in r["layers"]
    )
    cut = (risks[1] + risks[2]) / 2
    sc = suggest_config(r, "mxfp4", cut)
    assert len(sc["targeted_layers"]) == 2 and len(sc["kept_layers"]) == 2
    assert set(sc["config"]) == {"targets", "ignore"}
    assert all(v == "mxfp4" for v in sc["config"]["targets"].values())
    with pytest.raises(ValueError, match="did not measure"):
        suggest_config(r, "fp8_per_tensor", 0.1)


def test_policy_column_follows_the_flags(bf16):
    r = audit(bf16, ("mxfp4",), Settings(fp8bmm=False, fp4bmm=True))
    assert {layer["policy"]["scheme"] for layer in r["layers"]} == {"mxfp4"}
    assert {layer["policy"]["rule"] for layer in r["layers"]} == {"flag"}
    r = audit(bf16, ("mxfp4",), OFF, '{"targets": {"model.layers.1.self_attn.kv_b_proj": "fp8_per_block"}}')
    assert r["layers"][1]["policy"]["rule"] == "targets" and r["layers"][0]["policy"]["scheme"] == "bf16"


def test_fp8_fp32_dequantize_is_the_single_rounding():
    """Fp8Weight.dequantize(float32) multiplies in fp32: the same single rounding as exact-then-round."""
    torch.manual_seed(0)
    for name in ("fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "fp8_per_block_fnuz"):
        w = torch.randn(4, 256, 160) * torch.logspace(-6, 3, 4)[:, None, None]
        p = get_scheme(name).prepare(w)
        assert torch.equal(p.dequantize(torch.float32), p.dequantize(torch.float64).float()), name

"""``mlaq bench-bmm``: runs end to end (tiny settings), rejects bad options, and its decode step is attention."""

from __future__ import annotations

import json

import torch

from mlaq.bmm import get_scheme
from mlaq.bmm.bench import GEOMETRIES, Geometry, decode_step, format_tables


def test_cli_json_and_table(mlaq_cli):
    args = [
        "bench-bmm",
        "--quick",
        "--schemes",
        "bf16,fp8_per_tensor",
        "--batches",
        "1,2",
        "--contexts",
        "64,128",
    ]
    proc = mlaq_cli(*args, "--max-cache-gib", "0.0002", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["memcpy_gbps"] > 0 and result["machine"]["torch_threads"] == 1
    assert {(r["geometry"], r["scheme"]) for r in result["bmm"]} == {
        (g.name, s) for g in GEOMETRIES for s in ("bf16", "fp8_per_tensor")
    }
    row = next(r for r in result["bmm"] if r["scheme"] == "fp8_per_tensor" and r["geometry"] == "GLM-5")
    assert row["weight_bytes"] == 64 * 192 * 512 + 64 * 512 * 256 + 2 * 4  # fp8 codes + one scale each
    decode = result["decode"]
    assert len(decode) == len(GEOMETRIES) * 2 * 2
    assert any("skipped" in r for r in decode) and any("step_ms" in r for r in decode)  # 0.0002 GiB cap
    text = format_tables(json.loads(proc.stdout, object_hook=_int_keys))
    for word in ("DeepSeek-V3", "GLM-5", "fp8_per_tensor", "memory copy", "skipped", "B=2"):
        assert word in text


def _int_keys(d: dict) -> dict:
    return {int(k) if k.isdigit() else k: v for k, v in d.items()}


def test_cli_rejects_bad_options(mlaq_cli):
    proc = mlaq_cli("bench-bmm", "--schemes", "fp8,bf16")
    assert proc.returncode == 2 and "unknown BMM scheme 'fp8'; known schemes:" in proc.stderr
    proc = mlaq_cli("bench-bmm", "--batches", "1,x")
    assert proc.returncode == 2 and "--batches takes comma-separated positive integers" in proc.stderr


def test_decode_step_is_absorbed_attention():
    """The bench's step equals naive attention: decompress K = W_UK c and V = W_UV c, softmax, project."""
    geo = Geometry("tiny", 3, 32, 16, 8, 24)
    n, lr, p, r, v = 3, 32, 16, 8, 24
    g = torch.Generator().manual_seed(0)
    w_uk, w_uv = torch.randn(n, p, lr, generator=g) / 4, torch.randn(n, lr, v, generator=g) / 4
    q_nope, q_pe = torch.randn(n, 2, p, generator=g), torch.randn(2, n, r, generator=g)
    cache = torch.randn(2, 50, lr + r, generator=g)
    scheme = get_scheme("fp32")
    got = decode_step(
        q_nope.bfloat16(),
        q_pe.bfloat16(),
        cache.bfloat16(),
        scheme.prepare(w_uk),
        scheme.prepare(w_uv),
        scheme,
        geo,
        0.1,
    )
    c_kv, k_pe = (
        cache[..., :lr].bfloat16().double(),
        cache[..., lr:].bfloat16().double(),
    )  # (B, T, L), (B, T, R)
    k_nope = torch.einsum("npl,btl->bntp", w_uk.double(), c_kv)  # naive: decompressed keys
    values = torch.einsum("nlv,btl->bntv", w_uv.double(), c_kv)
    scores = torch.einsum("nbp,bntp->bnt", q_nope.bfloat16().double(), k_nope)
    scores = scores + torch.einsum("bnr,btr->bnt", q_pe.bfloat16().double(), k_pe)
    want = torch.einsum("bnt,bntv->nbv", torch.softmax(scores * 0.1, -1), values)
    assert torch.allclose(got.double(), want, rtol=0.05, atol=0.02), (got.double() - want).abs().max()

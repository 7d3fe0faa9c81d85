"""RangeCheckpoint (byte-range reads, no memory map) against safetensors' own reader, and LayerSource's
layers against load_model's."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mlaq.model.loading.range_checkpoint import RangeCheckpoint, ShardMissingError
from model_helpers import write_tensors


@pytest.fixture
def ckpt(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(7, 5, generator=gen).to(torch.bfloat16),
        "b.weight": torch.randn(3, 4, generator=gen).to(torch.float8_e4m3fn),
        "b.weight_scale_inv": torch.rand(1, 1, generator=gen),
        "c.weight": torch.randint(0, 255, (4, 6), dtype=torch.uint8, generator=gen),
        "d.bias": torch.randn(9, generator=gen, dtype=torch.float64),
        "e.empty": torch.zeros(0, 3),
    }
    write_tensors(tmp_path, tensors, shards=2)
    return tmp_path, tensors


def test_every_tensor_as_safetensors_reads_it(ckpt) -> None:
    path, tensors = ckpt
    reader = RangeCheckpoint(path)
    assert sorted(reader.keys()) == sorted(tensors)
    for name in tensors:
        with safe_open(str(reader.file_of(name)), "pt") as f:
            expected = f.get_tensor(name)
        got = reader.get(name)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), name
    assert reader.bytes_read == sum(t.numel() * t.element_size() for t in tensors.values())


def test_rows(ckpt) -> None:
    path, tensors = ckpt
    reader = RangeCheckpoint(path)
    before = reader.bytes_read
    rows = reader.get_rows("a.weight", [0, 1, 2, 5])
    assert torch.equal(rows, tensors["a.weight"][[0, 1, 2, 5]])
    assert reader.bytes_read - before == 4 * 5 * 2  # only those rows
    with pytest.raises(ValueError, match=r"row ids must lie in 0\.\.6"):
        reader.get_rows("a.weight", [7])


def test_missing_and_truncated_shards(ckpt) -> None:
    path, _ = ckpt
    reader = RangeCheckpoint(path)
    reader.file_of("a.weight").unlink()
    with pytest.raises(ShardMissingError, match="is missing: it was there when the run started"):
        reader.get("a.weight")
    with pytest.raises(FileNotFoundError, match="names shard"):
        RangeCheckpoint(path)


def test_truncated_file_is_a_clear_error(tmp_path) -> None:
    save_file({"x": torch.ones(100)}, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-8])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        RangeCheckpoint(tmp_path)


@pytest.mark.parametrize("slab", [2**24, 1])
def test_layer_source_holds_what_load_model_loads(tmp_path, monkeypatch, slab) -> None:
    """Every streamed layer (routed experts one by one), the final norm and the head hold exactly the
    loaded model's values, on an FP8-block checkpoint (dequantized as the loader does; slab=1: one
    128-row block row at a time)."""
    import mlaq.model.loading.layer_source as layer_source

    monkeypatch.setattr(layer_source, "SLAB_ELEMENTS", slab)
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from mlaq.model import load_model
    from mlaq.model.loading.layer_source import EXPERTS, LayerSource
    from mlaq.settings import Settings
    from quant_helpers import quantize_checkpoint
    from validate_helpers import tiny_checkpoint

    path = tiny_checkpoint(tmp_path / "fp8")
    quantize_checkpoint(path, "fp8")
    model = load_model(path, dtype=torch.bfloat16, settings=Settings())
    source = LayerSource(path)
    assert source.num_layers == len(model.model.layers) == 3
    for i, loaded in enumerate(model.model.layers):
        layer = source.layer(i, [torch.bfloat16]).modules[torch.bfloat16]
        params = dict(layer.named_parameters())
        for name, p in loaded.named_parameters():
            if name.startswith(EXPERTS) or name.startswith(("embed_tokens", "shared_head.head")):
                continue
            assert torch.equal(params[name], p), (i, name)
        if source.is_moe(i):
            expert = source.expert(i, 3, [torch.bfloat16])[torch.bfloat16]
            for name, p in expert.named_parameters():
                assert torch.equal(p, loaded.get_parameter(f"{EXPERTS}3.{name}")), (i, name)
    assert torch.equal(source.norm([torch.bfloat16])[torch.bfloat16].weight, model.model.norm.weight)
    assert torch.equal(source.head([torch.bfloat16])[torch.bfloat16], model.lm_head.weight)

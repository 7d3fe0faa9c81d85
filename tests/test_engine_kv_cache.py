"""Paged latent KV cache: block accounting, gather of ragged batches, rollback, fp8 storage error."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from mlaq.engine.block_manager import BlockManager
from mlaq.engine.kv_cache import (
    KVCacheDtype,
    LatentCacheConfig,
    LatentKVCache,
    dequantize_fp8_e4m3,
    quantize_fp8_e4m3,
)

L, R = 12, 4  # kv_lora_rank, qk_rope_head_dim (small stand-ins for 512 + 64)


def make(num_blocks=8, block_size=4, max_model_len=24, layers=2, dtype=torch.float32, kv="auto"):
    bm = BlockManager(num_blocks, block_size, max_model_len)
    cfg = LatentCacheConfig(layers, L, R, num_blocks, block_size, dtype=dtype, kv_cache_dtype=kv)
    return bm, LatentKVCache(cfg)


# -- block manager ----------------------------------------------------------------------------


def test_grow_truncate_free_account_for_every_block():
    bm = BlockManager(num_blocks=6, block_size=4, max_model_len=20)
    bm.grow("a", 5)  # 2 blocks
    bm.grow("b", 4)  # 1 block
    assert bm.block_table("a") == [0, 1] and bm.block_table("b") == [2]
    assert bm.num_free_blocks == 3
    bm.grow("a", 9)  # a third block for a
    assert bm.block_table("a") == [0, 1, 3] and bm.num_tokens("a") == 9
    bm.truncate("a", 4)  # rollback to exactly one full block
    assert bm.block_table("a") == [0] and bm.num_free_blocks == 4
    bm.free("b")
    bm.free("a")
    assert bm.num_free_blocks == 6
    with pytest.raises(ValueError, match="unknown sequence 'a'"):
        bm.free("a")


def test_slot_mapping_follows_the_block_table():
    bm = BlockManager(num_blocks=4, block_size=4, max_model_len=16)
    bm.grow("x", 2)
    bm.grow("y", 3)
    bm.grow("x", 6)  # x: blocks [0, 2]
    assert bm.slot_mapping("x", 0, 6).tolist() == [0, 1, 2, 3, 8, 9]
    assert bm.slot_mapping("y", 1, 3).tolist() == [5, 6]
    with pytest.raises(ValueError, match="outside sequence 'x' of 6 slots"):
        bm.slot_mapping("x", 4, 7)


def test_clear_errors_when_a_prompt_does_not_fit():
    bm = BlockManager(num_blocks=3, block_size=4, max_model_len=16)
    with pytest.raises(ValueError, match="17 tokens does not fit max_model_len=16"):
        bm.check_fits(17)
    with pytest.raises(ValueError, match="needs 4 cache blocks of 4 tokens but the KV cache pool has only 3"):
        bm.check_fits(13)
    bm.grow("a", 8)
    assert not bm.can_grow("b", 8)
    with pytest.raises(ValueError, match="pool exhausted"):
        bm.grow("b", 8)
    assert bm.num_free_blocks == 1  # the failed request took nothing
    with pytest.raises(ValueError, match="cannot truncate"):
        bm.truncate("a", 9)


# -- storage and gather -----------------------------------------------------------------------


def test_gather_of_a_ragged_batch_returns_what_was_written():
    bm, cache = make()
    g = torch.Generator().manual_seed(0)
    lengths = {"a": 7, "b": 2, "c": 11}
    written: dict[tuple[str, int], list[torch.Tensor]] = {}
    # Interleave growth token by token so that the sequences' blocks are not contiguous.
    for step in range(max(lengths.values())):
        for s, n in lengths.items():
            if step < n:
                bm.grow(s, step + 1)
                for layer in range(2):
                    entry = torch.randn(1, L + R, generator=g)
                    cache.write(layer, bm.slot_mapping(s, step, step + 1), entry)
                    written.setdefault((s, layer), []).append(entry[0])
    order = ["b", "c", "a"]
    batch = bm.batch_slots(order)
    for layer in range(2):
        latents, lens = cache.gather(layer, batch)
        assert latents.shape == (3, 11, L + R) and lens.tolist() == [2, 11, 7]
        for row, s in enumerate(order):
            expected = torch.stack(written[(s, layer)])
            assert torch.equal(latents[row, : lengths[s]], expected)
            assert torch.all(latents[row, lengths[s] :] == 0)
        c_kv, k_pe = cache.split(latents)
        assert c_kv.shape[-1] == L and k_pe.shape[-1] == R


def test_gather_layers_equals_per_layer_gathers_call_after_call():
    """gather_layers (all layers in one gather) returns exactly what the per-layer gathers do (zeros past
    each length), for batches of different shapes one after another."""
    bm, cache = make()
    g = torch.Generator().manual_seed(1)
    for s, n in {"a": 7, "b": 3, "c": 12}.items():
        bm.grow(s, n)
        for layer in range(2):
            cache.write(layer, bm.slot_mapping(s, 0, n), torch.randn(n, L + R, generator=g))
    for order in (["a", "b"], ["c", "a", "b"], ["b"], ["b", "a"]):
        batch = bm.batch_slots(order)
        both = cache.gather_layers(2, batch)
        expected = [cache.gather(layer, batch)[0] for layer in range(2)]
        for layer in range(2):
            assert torch.equal(both[layer], expected[layer]), (order, layer)


def test_speculative_rollback_frees_rejected_slots_and_rewrites():
    bm, cache = make(block_size=4)
    prompt = torch.randn(6, L + R)
    bm.grow("s", 6)
    cache.write(0, bm.slot_mapping("s", 0, 6), prompt)
    # Verification of k = 3 drafts writes 4 entries (last token + 3 drafts): positions 6..9.
    bm.grow("s", 10)
    cache.write(0, bm.slot_mapping("s", 6, 10), torch.full((4, L + R), 7.0))
    assert len(bm.block_table("s")) == 3
    bm.truncate("s", 7)  # 0 drafts accepted: keep the last token's entry only
    assert len(bm.block_table("s")) == 2 and bm.num_free_blocks == 6
    bm.grow("s", 8)
    cache.write(0, bm.slot_mapping("s", 7, 8), torch.full((1, L + R), -1.0))
    latents, _ = cache.gather(0, bm.batch_slots(["s"]))
    assert torch.equal(latents[0, :6], prompt)
    assert torch.all(latents[0, 6] == 7.0) and torch.all(latents[0, 7] == -1.0)


def test_write_checks_shapes_and_auto_keeps_the_model_dtype():
    bm, cache = make(dtype=torch.bfloat16)
    assert cache.data.dtype == torch.bfloat16
    bm.grow("s", 2)
    with pytest.raises(ValueError, match="expected \\(T, L \\+ R = 12 \\+ 4\\)"):
        cache.write(0, bm.slot_mapping("s", 0, 2), torch.zeros(2, L))
    x = torch.randn(2, L + R)
    cache.write(1, bm.slot_mapping("s", 0, 2), x)
    latents, _ = cache.gather(1, bm.batch_slots(["s"]))
    assert latents.dtype == torch.bfloat16 and torch.equal(latents[0], x.to(torch.bfloat16))


def test_indexer_columns_ride_along_exactly_while_the_latent_is_fp8():
    bm = BlockManager(4, 4, 16)
    cfg = LatentCacheConfig(2, L, R, 4, 4, torch.float32, "fp8_e4m3", extra_dims=(0, 5))
    cache = LatentKVCache(cfg)
    bm.grow("s", 3)
    x = torch.randn(3, L + R + 5) * 3
    cache.write(1, bm.slot_mapping("s", 0, 3), x)
    back, _ = cache.gather(1, bm.batch_slots(["s"]))
    assert torch.equal(back[0, :, L + R :], x[:, L + R :])  # indexer keys: model dtype, exact
    fp8 = dequantize_fp8_e4m3(quantize_fp8_e4m3(x[:, : L + R], 1.0), 1.0, torch.float32)
    assert torch.equal(back[0, :, : L + R], fp8)
    with pytest.raises(ValueError, match="\\+ 5 indexer"):
        cache.write(1, bm.slot_mapping("s", 0, 3), x[:, : L + R])
    with pytest.raises(ValueError, match="extra_dims needs one value"):
        LatentCacheConfig(2, L, R, 4, extra_dims=(1,))


def test_kv_cache_dtype_parsing():
    assert KVCacheDtype.parse("fp8") is KVCacheDtype.FP8_E4M3
    assert KVCacheDtype.parse("auto") is KVCacheDtype.AUTO
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'fp8_e5m2'"):
        KVCacheDtype.parse("fp8_e5m2")
    with pytest.raises(ValueError, match="scale must be a positive finite"):
        LatentCacheConfig(1, L, R, 4, scale=0.0)


# -- fp8_e4m3 ---------------------------------------------------------------------------------


def test_fp8_storage_is_bit_exact_against_ml_dtypes():
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(4000, generator=g) * 10 ** torch.empty(4000).uniform_(-4, 3, generator=g)])
    x = torch.cat([x, torch.tensor([448.0, 464.0, 1e6, -1e6, float("inf"), float("-inf"), 2.0**-10])])
    for scale in (1.0, 0.37):
        ours = quantize_fp8_e4m3(x, scale).view(torch.uint8).numpy()
        oracle = np.clip(x.numpy() / np.float32(scale), -448, 448).astype(ml_dtypes.float8_e4m3fn)
        assert np.array_equal(ours, oracle.view(np.uint8)), scale
    saturated = dequantize_fp8_e4m3(quantize_fp8_e4m3(x[-7:-1], 1.0), 1.0, torch.float32)
    assert saturated.tolist() == [448.0, 448.0, 448.0, -448.0, 448.0, -448.0]  # clamp, never NaN


def realistic_latents(n: int, seed: int = 2) -> torch.Tensor:
    """[c_kv | k_pe]: c_kv = RMSNorm(x) * w (O(1)), k_pe = RoPE(W_KR x) with heavier scale."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 512, generator=g) * 3.0
    w = 1.0 + 0.2 * torch.randn(512, generator=g)
    c_kv = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w  # (n, 512)
    k_pe = torch.randn(n, 64, generator=g) * 4.0  # rotation keeps the magnitude: O(1..10)
    return torch.cat([c_kv, k_pe], dim=-1)  # (n, 576)


def test_fp8_cache_error_on_realistic_latents():
    latents = realistic_latents(256)
    bm = BlockManager(32, 16, 512)
    cache = LatentKVCache(LatentCacheConfig(1, 512, 64, 32, 16, torch.float32, KVCacheDtype.FP8_E4M3))
    bm.grow("s", 256)
    cache.write(0, bm.slot_mapping("s", 0, 256), latents)
    back, _ = cache.gather(0, bm.batch_slots(["s"]))
    err = back[0] - latents
    rel_rms = float(err.norm() / latents.norm())
    # 3 mantissa bits, round to nearest: at most 2^-4 relative on normal values, ~2.7 % RMS on
    # Gaussian-like data (formats.md measures 2.65 % for e4m3 per-tensor on N(0, 1)).
    assert 0.02 < rel_rms < 0.035, f"relative RMS error {rel_rms:.4f}"
    normal = latents.abs() >= 2.0**-6
    worst = float((err[normal].abs() / latents[normal].abs()).max())
    assert worst <= 2.0**-4, f"worst relative error on normal values {worst:.4f}"
    assert float(err[~normal].abs().max()) <= 2.0**-10  # half the subnormal step 2^-9


def test_fp8_with_scale_one_hurts_tiny_latents_and_a_scale_fixes_it():
    tiny = realistic_latents(64) * 1e-3  # values ~1e-3: below e4m3's normal range at scale 1
    rel = {}
    for scale in (1.0, 1e-3):
        back = dequantize_fp8_e4m3(quantize_fp8_e4m3(tiny, scale), scale, torch.float32)
        rel[scale] = float((back - tiny).norm() / tiny.norm())
    assert rel[1.0] > 0.1, rel  # subnormal steps of 2^-9: a gross error
    assert rel[1e-3] < 0.035, rel


def test_lone_sequence_in_consecutive_blocks_reads_as_a_view():
    """The zero-copy read of one sequence equals the gather; scattered blocks fall back to it."""
    L, R = 8, 4
    bm = BlockManager(8, 4, 32)
    cache = LatentKVCache(LatentCacheConfig(2, L, R, 8, 4, torch.float32))
    cache.data.normal_()
    bm.grow("a", 10)  # blocks 0, 1, 2
    batch = bm.batch_slots(["a"])
    assert batch.first_slot == 0
    view = cache.gather_layers(2, batch)
    assert view.data_ptr() == cache.data.data_ptr()
    gathered = torch.stack([cache.gather(layer, batch)[0] for layer in range(2)])
    assert torch.equal(view, gathered)
    bm.grow("b", 4)  # block 3
    bm.grow("a", 13)  # block 4: "a" is now [0, 1, 2, 4]
    assert bm.batch_slots(["a"]).first_slot is None
    assert bm.batch_slots(["a"], [12]).first_slot == 0  # its first 12 tokens are still consecutive
    assert bm.batch_slots(["a", "b"]).first_slot is None


def test_consecutive_slots_write_as_a_slice():
    """slot_index: a slice when a write's slots are consecutive, else the slots_of tensor; writing a
    slice, or one stacked (layers, T, E) tensor, stores what the per-layer tensor-indexed write does."""
    bm, cache = make()
    bm.grow("a", 6)  # blocks 0, 1
    bm.grow("b", 4)  # block 2
    bm.grow("a", 9)  # block 3: "a" is [0, 1, 3]
    assert bm.slot_index([("a", 4, 8)]) == slice(4, 8)  # inside blocks 0, 1: consecutive
    assert bm.slot_index([("a", 5, 6)]) == slice(5, 6)  # a decode row
    scattered = bm.slot_index([("a", 6, 9)])  # crosses from block 1 into block 3
    assert isinstance(scattered, torch.Tensor) and torch.equal(scattered, bm.slots_of([("a", 6, 9)]))
    assert torch.equal(bm.slot_index([("a", 0, 2), ("b", 0, 2)]), bm.slots_of([("a", 0, 2), ("b", 0, 2)]))
    entries = torch.randn(2, 4, L + R, generator=torch.Generator().manual_seed(0))  # (layers, T, E)
    _, reference = make()
    for layer in range(2):
        reference.write(layer, bm.slots_of([("a", 4, 8)]), entries[layer])
    cache.write_layers(slice(4, 8), entries)  # stacked, at a slice
    assert torch.equal(cache.data, reference.data)
    _, per_layer = make()
    per_layer.write_layers(slice(4, 8), list(entries))
    assert torch.equal(per_layer.data, reference.data)
    with pytest.raises(ValueError, match="at 3 slots"):
        cache.write(0, slice(4, 7), entries[0])

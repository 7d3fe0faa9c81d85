"""Per-row positions: rows of different lengths in one batch, the ModelCache's per-row lengths, the
RoPE table, the small-batch MoE path."""

from __future__ import annotations

import pytest
import torch

from mlaq.model import ModelCache, load_model
from mlaq.model.layers.rope import Rope, RopeTable, YarnScaling
from mlaq.settings import Settings
from model_helpers import add_mtp_layer, hf_checkpoint

OFF = Settings(fp8bmm=False, fp4bmm=False)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("ckpt")
    hf, _ = hf_checkpoint("deepseek_v3", path, num_hidden_layers=2)
    add_mtp_layer(hf, path)
    return load_model(path, settings=OFF)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.abs().max())


def test_rows_of_different_lengths_equal_each_row_alone(model):
    """Right-padded prefill, then per-row positions for decode and MTP: every row as if alone."""
    g = torch.Generator().manual_seed(0)
    lens = [7, 3, 5]
    ids = torch.randint(3, model.config.vocab_size, (3, 7), generator=g)
    nxt = torch.randint(3, model.config.vocab_size, (3, 2), generator=g)
    cache = ModelCache()
    pre = model.prefill(ids, cache)  # pad tokens continue each row's positions; overwritten below
    model.mtp_step(ids[:, 1:], pre.hidden[:, :-1], cache)  # MTP cache: positions 0..5 (tails padding)
    last = torch.tensor(lens) - 1
    mtp = model.mtp_step(
        nxt[:, :1], pre.hidden[torch.arange(3), last][:, None], cache, positions=last[:, None]
    )
    positions = torch.tensor(lens)[:, None] + torch.arange(2)  # (3, 2)
    out = model.decode(nxt, cache, positions=positions)
    assert cache.lengths(0) == (9, 5, 7)
    assert cache.lengths(model.config.num_hidden_layers) == tuple(lens)
    for row, length in enumerate(lens):
        alone = ModelCache()
        first = model.prefill(ids[row : row + 1, :length], alone)
        want = model.decode(nxt[row : row + 1], alone)  # default positions: after the cached tokens
        assert _rel(out.logits[row], want.logits[0]) <= 1e-5
        model.mtp_step(ids[row : row + 1, 1:length], first.hidden[:, :-1], alone)
        got = model.mtp_step(nxt[row : row + 1, :1], first.hidden[:, -1:], alone)
        assert _rel(mtp.logits[row], got.logits[0]) <= 1e-5


def test_per_row_default_positions_continue_each_row(model):
    ids = torch.randint(3, model.config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(1))
    cache = ModelCache()
    model.prefill(ids, cache)
    cache.truncate(2, layers=None)
    model.decode(ids[:, 2:3], cache)
    assert cache.lengths(0) == (3, 3) and cache.length(0) == 3


def test_positions_must_be_consecutive_and_continue_the_cache(model):
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="consecutive"):
        model.prefill(ids, positions=torch.tensor([[0, 2, 3]]))
    cache = ModelCache()
    model.prefill(ids, cache)
    with pytest.raises(ValueError, match="only 3 are cached"):
        model.decode(ids[:, :1], cache, positions=torch.tensor([[5]]))
    with pytest.raises(ValueError, match="must match input_ids"):
        model.decode(ids[:, :1], cache, positions=torch.tensor([[3, 4]]))


@pytest.mark.parametrize("yarn", [None, YarnScaling(40.0, 4096, mscale=1.0, mscale_all_dim=1.0)])
def test_rope_table_equals_direct_cos_sin_and_grows(yarn):
    rope = Rope(64, 10000.0, yarn=yarn)
    table = RopeTable(rope)
    for positions in (torch.tensor([[0, 1, 2]]), torch.tensor([[5], [300]]), torch.tensor([[4097, 4098]])):
        cos, sin = table.cos_sin(positions)
        want_cos, want_sin = rope.cos_sin(positions)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert table._tables[torch.device("cpu")][0].shape[0] > 4098


def test_logits_index_keeps_one_position_per_row(model):
    ids = torch.randint(3, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
    index = torch.tensor([4, 1])
    full = model.prefill(ids)
    one = model.prefill(ids, logits_index=index)
    assert one.logits.shape == (2, 1, model.config.vocab_size) and torch.equal(one.hidden, full.hidden)
    assert _rel(one.logits[:, 0], full.logits[torch.arange(2), index]) <= 1e-6
    mtp_full = model.mtp_step(ids[:, 1:], full.hidden[:, :-1], ModelCache())
    mtp_one = model.mtp_step(ids[:, 1:], full.hidden[:, :-1], ModelCache(), logits_index=index - 1)
    assert _rel(mtp_one.logits[:, 0], mtp_full.logits[torch.arange(2), index - 1]) <= 1e-6
    with pytest.raises(ValueError, match="logits_index must have shape"):
        model.prefill(ids, logits_index=torch.tensor([1]))


@pytest.mark.parametrize("starts", [(0,), (0, 0, 0), (0, 2), (3,), (1, 1)])
@pytest.mark.parametrize("t", [1, 2, 6])
def test_step_causal_flag_is_the_square_lower_triangle(starts, t):
    """StepPositions.causal (the naive path then skips comparing the mask) holds exactly when the
    mask is the square causal mask is_causal recognises."""
    from mlaq.model.layers import mla_core
    from mlaq.model.layers.step import step_positions

    step = step_positions(starts, t, RopeTable(Rope(8, 10000.0)))
    assert step.causal == mla_core.is_causal(step.mask)
    assert step.causal == (t > 1 and max(starts) == 0)


def test_prefill_passes_the_causal_flag_instead_of_checking_the_mask(model, monkeypatch):
    from mlaq.model.layers import mla_core

    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    want = model.prefill(ids, ModelCache()).logits
    checked = []
    real = mla_core.is_causal
    monkeypatch.setattr(mla_core, "is_causal", lambda m: checked.append(1) or real(m))
    assert torch.equal(model.prefill(ids, ModelCache()).logits, want)
    assert checked == []  # known from the positions: the (T, K) mask was not compared
    cache = ModelCache()
    model.prefill(ids[:, :4], cache)
    model.prefill(ids[:, 4:], cache)  # continuing a cache: not the square mask, checked
    assert checked

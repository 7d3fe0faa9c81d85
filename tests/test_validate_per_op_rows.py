"""The per-op figures read at most PER_OP_ROWS evenly spaced query rows of a window: the same figures as
the BMM inputs cut to those rows by hand, and fewer rows than the window holds once it is longer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from validate_helpers import CHARS, eval_text, local_config, tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny_per_op_rows"))


def test_per_op_figures_read_evenly_spaced_rows(checkpoint, monkeypatch) -> None:
    from mlaq.validate import theory
    from mlaq.validate.capture import capture_reference
    from mlaq.validate.variants import ModelPool

    cfg = local_config(checkpoint, schemes=("fp8_per_tensor",))
    pool = ModelPool(cfg)
    model = pool.model(cfg.variants()[0])
    index = {ch: i for i, ch in enumerate(CHARS)}
    ids = torch.tensor([[index.get(ch, 0) for ch in eval_text()[:90]]])
    inp = capture_reference(model, ids).layers[0]
    monkeypatch.setattr(theory, "PER_OP_ROWS", 32)  # 90 rows -> every 3rd: rows 0, 3, ..., 87
    x_uk, x_uv = theory.op_inputs(inp)
    assert x_uk.shape[1] == x_uv.shape[1] == 30
    assert torch.equal(x_uk, inp.bmm_inputs[0][:, ::3]) and torch.equal(x_uv, inp.bmm_inputs[1][:, ::3])
    ab = model.model.layers[0].self_attn.absorbed
    cut = dataclasses.replace(inp, bmm_inputs=(x_uk.clone(), x_uv.clone()))
    monkeypatch.setattr(theory, "PER_OP_ROWS", 10_000)  # no further cut: the hand-cut rows as they are
    by_hand = theory.op_errors(ab, ab, cut)
    monkeypatch.setattr(theory, "PER_OP_ROWS", 32)
    assert theory.op_errors(ab, ab, inp) == by_hand
    assert theory.operand_stats(ab, inp) == theory.operand_stats(ab, cut)
    monkeypatch.setattr(theory, "PER_OP_ROWS", 90)  # a window within the cap: every row
    assert theory.op_inputs(inp)[0].shape[1] == 90

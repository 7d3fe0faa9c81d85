"""The captured reference inputs replayed per layer: projected once, attended under every scheme."""

from __future__ import annotations

import pytest
import torch

from mlaq.validate.capture import attention_output, capture_reference, project_input

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from validate_helpers import CHARS, eval_text, tiny_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from mlaq.model import load_model
    from mlaq.settings import Settings

    path = tiny_checkpoint(tmp_path_factory.mktemp("tiny_capture"))
    m = load_model(path, dtype=torch.bfloat16, settings=Settings())
    _prepare(m, "bf16")
    return m


def _prepare(model, scheme: str) -> None:
    for layer in model.model.layers:
        layer.self_attn.prepare(scheme)


def test_projected_once_replays_every_scheme_bit_for_bit(model) -> None:
    _prepare(model, "bf16")
    index = {ch: i for i, ch in enumerate(CHARS)}
    ids = torch.tensor([[index.get(ch, 0) for ch in eval_text()[:120]]])
    window = capture_reference(model, ids)
    assert any(inp.mtp for inp in window.layers)
    projected = [project_input(model, inp) for inp in window.layers]  # under bf16
    for inp, proj in zip(window.layers, projected, strict=True):
        assert torch.equal(attention_output(model, inp, proj), inp.ref_out)  # the reference reproduced
    _prepare(model, "mxfp4")  # re-prepared: the projections are reused, the BMMs are mxfp4's
    try:
        for inp, proj in zip(window.layers, projected, strict=True):
            got, fresh = attention_output(model, inp, proj), attention_output(model, inp)
            assert torch.equal(got, fresh)
            assert not torch.equal(got, inp.ref_out)
        with pytest.raises(ValueError, match="replayed on layer"):
            attention_output(model, window.layers[0], projected[1])
    finally:
        _prepare(model, "bf16")


def test_the_streams_first_layer_is_its_replay(model) -> None:
    """validate reuses the stream's first-layer attention as that layer's replay (same model: the
    first layer's input does not depend on the BMMs): it must be the replay, bit for bit."""
    from mlaq.validate.sources.windows import _teacher_forced_logits

    _prepare(model, "bf16")
    index = {ch: i for i, ch in enumerate(CHARS)}
    ids = torch.tensor([[index.get(ch, 0) for ch in eval_text()[:100]]])
    window = capture_reference(model, ids)
    _prepare(model, "mxfp4")
    try:
        first = window.layers[0]
        logits, out = _teacher_forced_logits(model, ids, first.layer)
        assert out is not None and logits.shape == (100, len(CHARS))
        assert torch.equal(out, attention_output(model, first))
        assert not torch.equal(out, first.ref_out)
        assert _teacher_forced_logits(model, ids)[1] is None
    finally:
        _prepare(model, "bf16")


def test_shared_exact_products_give_each_schemes_per_op_errors_bit_for_bit(model) -> None:
    """validate computes a layer's exact BMM products once (theory.exact) and shares them across the
    schemes' op_errors and operand_stats: the figures must be those computed from scratch."""
    import dataclasses

    from mlaq.validate.theory import exact, op_errors, operand_stats

    _prepare(model, "bf16")
    index = {ch: i for i, ch in enumerate(CHARS)}
    ids = torch.tensor([[index.get(ch, 0) for ch in eval_text()[:100]]])
    window = capture_reference(model, ids)
    refs = {inp.layer: model.model.layers[inp.layer].self_attn.absorbed for inp in window.layers}
    shared = {inp.layer: exact(refs[inp.layer], inp) for inp in window.layers}
    for inp in window.layers:
        assert operand_stats(refs[inp.layer], inp, shared[inp.layer]) == operand_stats(refs[inp.layer], inp)
    try:
        for scheme in ("mxfp4", "fp8_per_block"):
            _prepare(model, scheme)
            for inp in window.layers:
                ab, ref = model.model.layers[inp.layer].self_attn.absorbed, refs[inp.layer]
                got = op_errors(ab, ref, inp, shared[inp.layer])
                assert got == op_errors(ab, ref, inp)
                assert got.bmm_uk > 0 and got.bmm_uv > 0
                # the products are the reference's: other products give other errors
                wrong = dataclasses.replace(shared[inp.layer], y_uk=shared[inp.layer].y_uk * 1.01)
                assert op_errors(ab, ref, inp, wrong).bmm_uk != got.bmm_uk
    finally:
        _prepare(model, "bf16")

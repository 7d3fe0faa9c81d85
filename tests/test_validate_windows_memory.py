"""validate's teacher-forced windows hold no query x key tensor between layers and free the BMM inputs
after the per-op figures: the figures must be those computed from scratch, scheme by scheme."""

from __future__ import annotations

import pytest
import torch

from mlaq.validate.capture import capture_reference, project_input

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from validate_helpers import CHARS, eval_text, local_config, tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny_windows"))


def _ids(n: int) -> torch.Tensor:
    index = {ch: i for i, ch in enumerate(CHARS)}
    return torch.tensor([[index.get(ch, 0) for ch in eval_text()[:n]]])


def test_projected_input_holds_no_query_by_key_tensor(checkpoint) -> None:
    """A (T, K) mask per layer and model is 256 MiB at 16,384 tokens: it is built when replayed."""
    from mlaq.validate.variants import ModelPool

    cfg = local_config(checkpoint, schemes=("mxfp4",))
    model = ModelPool(cfg).model(cfg.variants()[0])
    t = 100  # not the latent width of the tiny model (96)
    window = capture_reference(model, _ids(t))
    for inp in window.layers:
        t = inp.hidden.shape[1]  # the MTP layer's window is one token shorter
        p = project_input(model, inp)
        for name, value in vars(p).items():
            if isinstance(value, torch.Tensor):
                assert tuple(value.shape[-2:]) != (t, t), f"{name} {tuple(value.shape)} is T x K"
        mask = p.mask(inp)
        assert mask.shape == (1, t, t) and torch.equal(mask[0], torch.ones(t, t, dtype=torch.bool).tril())


def test_teacher_forced_per_op_figures_are_each_schemes_own(checkpoint) -> None:
    """The per-op errors run for every scheme before the streams (then the BMM inputs are freed):
    each scheme's figures must be those of its own weights on the reference's inputs."""
    from mlaq.validate.config import NOISE_FLOOR, REFERENCE
    from mlaq.validate.metrics import Buckets
    from mlaq.validate.progress import NullProgress
    from mlaq.validate.sources.windows import Run, teacher_forced
    from mlaq.validate.theory import op_errors
    from mlaq.validate.variants import ModelPool

    cfg = local_config(checkpoint, schemes=("mxfp4", "fp8_per_block"))
    others = [NOISE_FLOOR, *cfg.variants(REFERENCE)]
    runs = {v: Run(v) for v in [REFERENCE, *others]}
    pool = ModelPool(cfg)
    ids = _ids(80)
    teacher_forced(pool, runs, REFERENCE, others, [ids], Buckets(80, 4), NullProgress(), flip_rows=16)

    fresh = ModelPool(cfg)
    ref_model = fresh.model(REFERENCE)
    window = capture_reference(ref_model, ids)
    ref_abs = {i.layer: ref_model.model.layers[i.layer].self_attn.absorbed for i in window.layers}
    seen = set()
    for v in [REFERENCE, *cfg.variants(REFERENCE)]:
        model = fresh.model(v)
        want = [
            op_errors(model.model.layers[i.layer].self_attn.absorbed, ref_abs[i.layer], i)
            for i in window.layers
        ]
        got = runs[v].ops
        assert [(o.layer, o.bmm_uk, o.bmm_uv, o.weight_uk) for o in got] == [
            (o.layer, o.bmm_uk, o.bmm_uv, o.weight_uk) for o in want
        ], v.name
        seen.add(tuple(o.bmm_uk for o in got))
    assert len(seen) == 3  # bf16, mxfp4 and fp8_per_block differ
    assert all(runs[v].windows and runs[v].windows[0] for v in others)

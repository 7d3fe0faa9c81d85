"""One variant-window of ``mlaq validate``'s teacher-forced stage, the old way and the new way,
alternating in one process (fair on a loaded machine): CPU seconds (user+sys) of the stream and of the
per-layer replay, and whether the results are bit-identical.

    python bench/validate_window_ab.py [MODEL] [--scheme mxfp4] [--context-len 2048] [--reps 2]

old: whole-matrix latent attention (no query blocks), every layer replayed with its own projections;
new: blocked attention, projections made once per window (``project_input``, shared by every scheme),
the first layer's replay taken from the stream. The bf16 reference captures the window first.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from mlaq.model import ModelCache, Precision, load_model
from mlaq.model.layers import mla_latent
from mlaq.model.layers.mla import AttnPath
from mlaq.settings import Settings
from mlaq.validate.capture import attention_output, capture_reference, project_input
from mlaq.validate.config import bundled_model_dir
from mlaq.validate.sources.windows import _teacher_forced_logits


def prepare(model, scheme: str) -> None:
    for layer in model.model.layers:
        layer.self_attn.prepare(scheme)


def old(model, ids, window):
    block = mla_latent.QUERY_BLOCK
    mla_latent.QUERY_BLOCK = 1 << 30  # absorbed_attention then takes the whole-matrix path
    try:
        a = time.process_time()
        logits = model(ids, ModelCache(), path=AttnPath.ABSORBED).logits[0]
        b = time.process_time()
        outs = {inp.layer: attention_output(model, inp) for inp in window.layers}
        return b - a, time.process_time() - b, logits, outs
    finally:
        mla_latent.QUERY_BLOCK = block


def new(model, ids, window, projected):
    a = time.process_time()
    logits, first = _teacher_forced_logits(model, ids, window.layers[0].layer)
    b = time.process_time()
    outs = {window.layers[0].layer: first}
    for inp in window.layers[1:]:
        outs[inp.layer] = attention_output(model, inp, projected[inp.layer])
    return b - a, time.process_time() - b, logits, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", type=Path, default=None)
    parser.add_argument("--scheme", default="mxfp4")
    parser.add_argument("--context-len", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = args.model or bundled_model_dir()
    model = load_model(path, dtype=torch.bfloat16, settings=Settings(), precision=Precision.DECODE_ONLY)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, args.context_len), generator=torch.Generator().manual_seed(0))
    prepare(model, "bf16")
    window = capture_reference(model, ids)
    prepare(model, args.scheme)
    t = time.process_time()
    projected = {inp.layer: project_input(model, inp) for inp in window.layers[1:]}
    print(f"projections, once per window and model: {time.process_time() - t:.2f} s CPU")
    print(f"load average {os.getloadavg()[0]:.2f} (1 min); torch {torch.__version__}, 1 thread")
    same = True
    for _ in range(args.reps):
        so, ro, lo, oo = old(model, ids, window)
        sn, rn, ln, on = new(model, ids, window, projected)
        same &= torch.equal(lo, ln) and all(torch.equal(oo[k], on[k]) for k in oo)
        print(
            f"CPU s  old: stream {so:.2f} replay {ro:.2f} = {so + ro:.2f}   new: stream {sn:.2f} "
            f"replay {rn:.2f} = {sn + rn:.2f}",
            flush=True,
        )
    print(f"logits and replayed outputs bit-identical: {same}")


if __name__ == "__main__":
    main()

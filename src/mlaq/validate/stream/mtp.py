"""The MTP layer(s) of a streamed run: teacher-forced on the reference's final hidden states, as
validate's capture runs them, each layer's attention input replayed under every other variant."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from mlaq.model.layers.mtp import MTPLayer
from mlaq.model.layers.rope import RopeTable
from mlaq.model.layers.step import step_positions
from mlaq.model.loading.layer_source import LayerSource
from mlaq.validate.stream.streams import Stream, attention_stage


@torch.no_grad()
def mtp_stage(
    source: LayerSource,
    index: int,
    shift: int,
    hidden: list[Tensor],
    ids: Tensor,
    absorbed_for,  # (StreamedLayer) -> (Variant -> AbsorbedWeights): prepares one variant's BMMs
    streams: Sequence[Stream],
    operands: dict[int, dict[str, float]],
    chunk: int,
    fetch_mlp,
    flip_rows: int = 0,
) -> tuple[list[Tensor], int]:
    """MTP layer ``index`` (``shift`` tokens ahead) on the reference's hidden states (1, T', H) per
    window -> its output hidden states (what the next MTP layer consumes) and the experts read."""
    ref, others = streams[0], streams[1:]
    dtypes = list(dict.fromkeys(s.variant.dtype for s in streams))
    layer = source.layer(index, dtypes)
    prepare = absorbed_for(layer)
    mod = layer.modules[ref.variant.dtype]
    assert isinstance(mod, MTPLayer)
    own = f"model.layers.{index}.embed_tokens.weight"
    name = own if source.reader.has(own) else "model.embed_tokens.weight"
    tokens = ids[:, shift:]  # (W, T') the token after each hidden state's
    rows, remapped = source.embedding_rows(name, tokens)
    table = rows.to(mod.enorm.weight.dtype)
    xs = []
    for w, h in enumerate(hidden):
        e = mod.enorm(table[remapped[w : w + 1]])  # (1, T', H)
        hh = mod.hnorm(h[:, :-1].to(e.dtype))
        xs.append(mod.eh_proj(torch.cat((e, hh), dim=-1)))  # (1, T', 2H) -> (1, T', H)
    t = tokens.shape[1]
    step = step_positions((0,), t, RopeTable(source.mla_config.rope))
    # the reference's MTP pass keeps its own hidden states; its measurements land in the reference
    mtp_ref = Stream(ref.variant, xs, [None] * len(xs), ref.sums, ref.layers, ref.ops, ref.descriptions)
    attention_stage(
        index,
        True,
        layer.modules,
        prepare,
        mtp_ref,
        others,
        step,
        chunk,
        operands,
        run_others=False,
        flip_rows=flip_rows,
    )
    experts = fetch_mlp(index, layer.modules, [mtp_ref])
    return mtp_ref.x, experts

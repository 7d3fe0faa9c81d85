"""scripts/train_ctx.py's plan: the length curriculum (--phases), the LR schedule, and the model's context
(plain RoPE or DeepSeek-V3's YaRN by --yarn-factor, checked against the model a run starts from)."""

from __future__ import annotations

import argparse
import json

from tiny_model import TinyGeometry, yarn_parameters


def phases(spec: str) -> list[tuple[int, int, int]]:
    """'512x8:1200000,...' -> [(seq, batch, tokens), ...]."""
    out = []
    for part in spec.split(","):
        shape, tokens = part.split(":")
        seq, batch = shape.split("x")
        out.append((int(seq), int(batch), int(tokens)))
    return out


def phase_at(tokens: int, plan: list[tuple[int, int, int]]) -> int:
    """Index of the phase the run is in after `tokens` tokens (len(plan) when done)."""
    edge = 0
    for i, (_, _, n) in enumerate(plan):
        edge += n
        if tokens < edge:
            return i
    return len(plan)


def context(a: argparse.Namespace, geo: TinyGeometry, plan: list) -> tuple[TinyGeometry, dict | None]:
    """The geometry's context and rope: plain, or YaRN by --yarn-factor over the original context. A run
    from a model directory must start from that model's own context (no silent mismatch)."""
    original = geo.max_position_embeddings
    if a.init_from is not None and a.init_from.is_dir():
        hf = json.loads((a.init_from / "config.json").read_text())
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        theirs = (hf["max_position_embeddings"], 0.0)  # a plain model may be extended by any factor
        if rope.get("rope_type", rope.get("type", "default")) == "yarn":
            theirs = (rope["original_max_position_embeddings"], float(rope["factor"]))
        if theirs[0] != original or theirs[1] not in (0.0, float(a.yarn_factor)):
            raise SystemExit(f"{a.init_from}: context {theirs[0]} with YaRN factor {theirs[1] or 'none'}, but this "
                             f"run has {original} with {a.yarn_factor or 'none'}; pass a model of the "
                             "geometry's context (and the same --yarn-factor to continue a YaRN model)")  # fmt: skip
    rope_params = None
    if a.yarn_factor:
        if a.yarn_factor <= 1:
            raise SystemExit(f"--yarn-factor must be > 1, got {a.yarn_factor}")
        rope_params = yarn_parameters(a.yarn_factor, original)
        geo = TinyGeometry(**{**geo.__dict__, "max_position_embeddings": int(original * a.yarn_factor)})
    longest = max(seq for seq, _, _ in plan)
    if longest > geo.max_position_embeddings and not a.train_past_context:
        raise SystemExit(f"--phases reaches {longest} tokens, past the context {geo.max_position_embeddings}; "
                         "raise --yarn-factor, shorten the phases, or pass --train-past-context")  # fmt: skip
    return geo, rope_params


def lr_at(step: int, tokens: int, total: int, a: argparse.Namespace) -> float:
    lr = a.lr * min(1.0, (step + 1) / a.warmup)
    if a.decay_tokens and tokens > total - a.decay_tokens:
        lr *= 1 - 0.9 * (tokens - (total - a.decay_tokens)) / a.decay_tokens
    return lr

"""The report of a server validation as one JSON-ready dict, with local validate's key names where the
measurement is the same (kl, top1_agreement, nll_delta and their _by_bucket lists, generation,
acceptance_rate, mean_acceptance_length, per_position_acceptance_rate), so the two reports compare."""

from __future__ import annotations

import platform
import sys
from typing import TYPE_CHECKING, Any

import mlaq
from mlaq.validate.generation import Generation, acceptance_json, generation_json
from mlaq.validate.metrics import Buckets
from mlaq.validate.server.compare import nll_json, per_position, teacher_forced_json

if TYPE_CHECKING:
    from mlaq.validate.server.config import ServerValidateConfig
    from mlaq.validate.server.runner import Inputs, Side

FORMAT_VERSION = 1


def _generation(side: Side) -> Generation | None:
    if side.generations is None:
        return None
    return Generation(
        tuple(g.tokens for g in side.generations), side.acceptance, side.seconds.get("generation", 0.0)
    )


def _side_json(side: Side, reference: Side | None, ngram: int) -> dict[str, Any]:
    out: dict[str, Any] = {"server": side.identity}
    out.update(acceptance_json(side.acceptance))
    out["acceptance_source"] = side.acceptance_source
    gen = _generation(side)
    ref_gen = _generation(reference) if reference is not None else None
    if gen is not None:
        lengths_match = ref_gen is not None and [len(t) for t in ref_gen.tokens] == [
            len(t) for t in gen.tokens
        ]
        out["generation"] = generation_json(gen, ref_gen if lengths_match else None, ngram)
    out["errors"] = dict(side.errors)
    out["warnings"] = list(side.warnings)
    out["seconds"] = dict(side.seconds)
    return out


def assemble(
    cfg: ServerValidateConfig,
    inputs: Inputs,
    candidate: Side,
    reference: Side | None,
    timings: dict[str, float],
) -> dict[str, Any]:
    buckets = Buckets(inputs.context_len - 1, min(cfg.buckets, inputs.context_len - 1))
    edges = list(buckets.edges)
    cand = _side_json(candidate, reference, cfg.ngram)
    if candidate.windows is not None:
        cand.update(nll_json(candidate.windows, edges))
    ref = None
    if reference is not None:
        ref = _side_json(reference, None, cfg.ngram)
        if reference.windows is not None:
            ref.update(nll_json(reference.windows, edges))
        if reference.windows is not None and candidate.windows is not None:
            k = cfg.logprobs
            cand.update(teacher_forced_json(per_position(reference.windows, candidate.windows), edges, k))
        else:
            missing = reference.errors.get("teacher_forced") or candidate.errors.get("teacher_forced")
            cand["errors"].setdefault("teacher_forced", missing or "no teacher-forced data")
    return {
        "format_version": FORMAT_VERSION,
        "source": "server",
        "servers": {
            "candidate": candidate.identity,
            "reference": None if reference is None else reference.identity,
            "against": None if cfg.against is None else str(cfg.against),
        },
        "eval_text": inputs.eval_text,
        "config": {
            "context_len": inputs.context_len,
            "windows": len(inputs.windows),
            "buckets": buckets.count,
            "prompts": len(inputs.prompts),
            "prompt_len": len(inputs.prompts[0]) if inputs.prompts else 0,
            "max_tokens": inputs.max_tokens,
            "logprobs": cfg.logprobs,
            "concurrency": cfg.concurrency,
            "ngram": cfg.ngram,
            "record": None if cfg.record is None else str(cfg.record),
        },
        "seed": cfg.seed,
        "versions": {
            "mlaq": mlaq.__version__,
            "python": sys.version.split()[0],
            "platform": platform.platform(),
        },
        "buckets": [list(r) for r in buckets.ranges()],
        "reference": ref,
        "candidate": cand,
        "timings": timings,
    }

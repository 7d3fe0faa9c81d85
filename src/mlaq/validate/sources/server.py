"""Live servers as a measurement source: ``mlaq validate --server URL [--reference URL | --against FILE]``.

The servers do the work (mlaq.validate.server.measure); this module files what they answered into the
same ``Record`` the in-memory engine fills, so statistics, report.md, report.json, the PNGs and the
terminal table are the same code. What a server cannot measure stays empty (no per-layer attention
error, no per-op error: those need the weights); teacher-forced KL is the top-k estimate of
``mlaq.validate.topk_kl`` (exact when both servers return whole distributions). Each server's identity,
capabilities, errors and warnings go into the record's ``model["servers"]``.
"""

from __future__ import annotations

from typing import Any

import torch

from mlaq.validate.metrics import Buckets, BucketSums
from mlaq.validate.progress import NullProgress, Progress
from mlaq.validate.record import GenerationRecord, Record, SpecCounts, VariantRecord
from mlaq.validate.report_types import Report
from mlaq.validate.server.compare import decode_values, window_values
from mlaq.validate.server.config import ServerValidateConfig
from mlaq.validate.server.measure import measure_sides
from mlaq.validate.server.sides import Side
from mlaq.validate.server.spec import per_request_stats
from mlaq.validate.sources import common
from mlaq.validate.topk_kl import topk_kl


class ServerSource:
    name = "server"

    def __init__(self, config: ServerValidateConfig) -> None:
        self.config = config

    def measure(self, progress: Progress | None = None) -> Record:
        cfg = self.config
        sides = measure_sides(cfg, progress or NullProgress())
        inputs, cand, ref = sides.inputs, sides.candidate, sides.reference
        buckets = Buckets(inputs.context_len, min(cfg.shape.buckets, inputs.context_len))
        candidates: list[VariantRecord] = []
        if ref is None:  # the server alone (e.g. while recording): it is the reference of its report
            reference = _variant(cand, _name(cand), "reference", buckets)
        else:
            reference = _variant(ref, _name(ref), "reference", buckets)
            candidates.append(_variant(cand, _name(cand), "scheme", buckets, ref))
        spec = next((s.acceptance for s in (cand, ref) if s is not None and s.acceptance is not None), None)
        return Record(
            model=_model(cfg, cand, ref),
            eval_text={**inputs.eval_text, "prompt_sample": inputs.prompt_sample},
            config={
                "schemes": [],
                "as_configured": False,
                "settings": None,
                "quantization_config": None,
                "quantization": None,
                "precision": "as served",
                "context_len": inputs.context_len,
                "windows": len(inputs.windows),
                "buckets": buckets.count,
                "prompts": len(inputs.prompts),
                "prompt_len": len(inputs.prompts[0]) if inputs.prompts else 0,
                "max_tokens": inputs.max_tokens,
                "num_speculative_tokens": len(spec.num_accepted_tokens_per_pos) if spec is not None else 0,
                "ngram": cfg.shape.ngram,
                "threads": None,
                "logprobs": cfg.logprobs,
                "concurrency": cfg.concurrency,
                "against": None if cfg.against is None else str(cfg.against),
                "record": None if cfg.record is None else str(cfg.record),
            },
            seed=cfg.shape.seed,
            versions=common.versions(),
            buckets=[list(r) for r in buckets.ranges()],
            reference=reference,
            noise_floor=None,
            candidates=candidates,
            operands={},
            timings={**{f"{k} (candidate)": v for k, v in cand.seconds.items()}, "total": sides.seconds},
            source=self.name,
            tasks=sides.suite,
        )


def _name(side: Side) -> str:
    """The row label: served model @ host:port (or "recording")."""
    ident = side.identity
    where = "recording" if ident.get("recording") else str(ident.get("url", "")).split("://")[-1]
    return f"{ident.get('model')} @ {where}"


def _model(cfg: ServerValidateConfig, cand: Side, ref: Side | None) -> dict[str, Any]:
    def entry(s: Side) -> dict[str, Any]:
        return {
            **s.identity,
            "acceptance_source": s.acceptance_source,
            "errors": dict(s.errors),
            "warnings": list(s.warnings),
        }

    return {
        "path": cand.identity.get("url"),
        "model_type": "served",
        "served_model": cand.identity.get("model"),
        "max_position_embeddings": cand.identity.get("max_model_len"),
        "servers": {"candidate": entry(cand), "reference": None if ref is None else entry(ref)},
    }


def _variant(
    side: Side, name: str, kind: str, buckets: Buckets, reference: Side | None = None
) -> VariantRecord:
    windows: list[BucketSums] = []
    per_token: dict[str, list[list[float]]] = {}
    if reference is None and side.windows is not None:
        for w in side.windows:
            windows.append(sums := BucketSums(buckets))
            sums.add("nll", torch.arange(len(w.token_logprobs)), torch.from_numpy(-w.token_logprobs))
    elif reference is not None and side.windows is not None and reference.windows is not None:
        for r, c in zip(reference.windows, side.windows, strict=True):
            values = window_values(r, c)
            windows.append(sums := BucketSums(buckets))
            positions = torch.arange(len(values["kl"]))
            for key in ("kl", "top1", "nll_delta"):
                sums.add(key, positions, torch.tensor(values[key], dtype=torch.float64))
            for key, vals in values.items():
                per_token.setdefault(key, []).append(vals)
    if reference is not None and side.generations is not None and reference.generations is not None:
        for r, c in zip(reference.generations, side.generations, strict=True):
            values = decode_values(r, c)
            for key, vals in (values or {}).items():
                per_token.setdefault(f"decode_{key}", []).append(vals)
    if reference is not None and side.mc is not None and reference.mc is not None:
        per_token.update(mc_values(reference, side))
    gen = None
    if side.generations is not None:
        s = side.acceptance
        spec = (
            None
            if s is None
            else SpecCounts(
                s.num_drafts,
                s.num_draft_tokens,
                s.num_accepted_tokens,
                list(s.num_accepted_tokens_per_pos),
                _per_request(side) if side.acceptance_source == "per_request" else None,
            )
        )
        gen = GenerationRecord(
            [list(g.tokens) for g in side.generations], side.seconds.get("generation", 0.0), spec, side.sample
        )
    return VariantRecord(
        name=name,
        kind=kind,
        dtype="as served",
        positions=common.totals(windows) if windows else {},
        generation=gen,
        seconds=sum(side.seconds.values()),
        per_token=per_token,
        tasks=list(side.tasks or []),
    )


def mc_values(reference: Side, candidate: Side) -> dict[str, list[list[float]]]:
    """Per sampled continuation (--mc-kl), per sampled token: both sides' log-probabilities of it, and
    the top-k KL estimate at the same position with whether it was exact (whole distributions)."""
    out: dict[str, list[list[float]]] = {k: [] for k in ("mc_ref_logprob", "mc_cand_logprob", "mc_topk_kl")}
    out["mc_exact"] = []
    for r, c, start in zip(reference.mc or (), candidate.mc or (), reference.mc_start, strict=True):
        if r.tokens != c.tokens:
            raise ValueError("reference and candidate scored different sampled continuations")
        rows = range(start - 1, len(r.tokens) - 1)  # position t predicts token t + 1: the sampled ones
        est = [topk_kl(r.top[t], c.top[t]) for t in rows]
        out["mc_ref_logprob"].append([float(r.token_logprobs[t]) for t in rows])
        out["mc_cand_logprob"].append([float(c.token_logprobs[t]) for t in rows])
        out["mc_topk_kl"].append([e.kl for e in est])
        out["mc_exact"].append([float(e.exact) for e in est])
    return out


def run_server_validation(
    config: ServerValidateConfig, progress: Progress | None = None, verdicts: Any = None
) -> Report:
    """``runner.run(ServerSource(config), ...)``: the servers measured and summarized, the report."""
    from mlaq.validate.runner import run

    return run(ServerSource(config), progress, verdicts)


def _per_request(side: Side) -> list[list[int]] | None:
    """[draft tokens, accepted tokens] of each generation, from its response's metrics (None if any lacks them)."""
    per = [per_request_stats(g.spec) for g in side.generations or ()]
    if not per or any(s is None for s in per):
        return None
    return [[s.num_draft_tokens, s.num_accepted_tokens] for s in per if s is not None]

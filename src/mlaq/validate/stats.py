"""Statistics over a measurement record, as pure functions; ``summarize`` builds the report's JSON object.

Nothing here measures or reads a model: every figure is computed from a ``Record`` (see record.py), so a
record saved by one source, or built by hand in a test, gives the same report.
"""

from __future__ import annotations

import math
from statistics import fmean
from typing import Any

from mlaq.engine.spec_metrics import SpecDecodingStats
from mlaq.validate import mc_kl
from mlaq.validate.intervals import paired_ratio_bootstrap
from mlaq.validate.kld import KLD_QUANTILES, distribution, kld_statistics_by_bucket
from mlaq.validate.metrics import first_divergence, longest_loop, repeated_ngram_share
from mlaq.validate.record import GenerationRecord, Record, SpecCounts, Totals, VariantRecord
from mlaq.validate.report_types import Report
from mlaq.validate.task_stats import variant_task_figures
from mlaq.validate.theory import THEORY, theory_for
from mlaq.validate.topk_kl import estimator_summary
from mlaq.validate.verdict import VerdictConfig, verdict

FORMAT_VERSION = 1


def pooled(t: Totals) -> tuple[list[float], list[float]]:
    """Sums and counts per bucket, pooled over the windows."""
    sums = [math.fsum(col) for col in zip(*t.sums, strict=True)]
    counts = [math.fsum(col) for col in zip(*t.counts, strict=True)]
    return sums, counts


def bucket_mean(t: Totals) -> tuple[list[float | None], float]:
    """Per-bucket means (None for an empty bucket) and the mean over every token."""
    s, c = pooled(t)
    return [a / b if b else None for a, b in zip(s, c, strict=True)], math.fsum(s) / math.fsum(c)


def ratio_rms(num: Totals, den: Totals) -> tuple[list[float | None], float]:
    """sqrt(sum num / sum den) by bucket and overall: the relative RMS error."""
    a, _ = pooled(num)
    b, _ = pooled(den)
    per = [math.sqrt(x / y) if y else None for x, y in zip(a, b, strict=True)]
    return per, math.sqrt(math.fsum(a) / math.fsum(b))


def mean_of_lists(rows: list[list[float | None]]) -> list[float | None]:
    """Element-wise mean over rows, skipping None."""
    out: list[float | None] = []
    for col in zip(*rows, strict=True):
        vals = [v for v in col if v is not None]
        out.append(fmean(vals) if vals else None)
    return out


def _finite(x: float) -> float | None:
    return None if x != x else x  # nan (no drafts) -> null in JSON


def acceptance(spec: SpecCounts | None) -> dict[str, Any]:
    """vLLM's counters and rates (None everywhere without speculation)."""
    if spec is None:
        keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")
        rates = ("acceptance_rate", "mean_acceptance_length", "per_position_acceptance_rate")
        return dict.fromkeys(keys + rates)
    s = SpecDecodingStats(
        spec.num_drafts,
        spec.num_draft_tokens,
        spec.num_accepted_tokens,
        tuple(spec.num_accepted_tokens_per_pos),
    )
    return {
        "num_drafts": s.num_drafts,
        "num_draft_tokens": s.num_draft_tokens,
        "num_accepted_tokens": s.num_accepted_tokens,
        "num_accepted_tokens_per_pos": list(s.num_accepted_tokens_per_pos),
        "acceptance_rate": _finite(s.draft_acceptance_rate),
        "mean_acceptance_length": _finite(s.mean_acceptance_length),
        "per_position_acceptance_rate": [_finite(r) for r in s.per_position_acceptance_rate],
    }


def acceptance_ratio_ci(ref: SpecCounts, cand: SpecCounts, seed: int) -> list[float] | None:
    """95 % paired bootstrap interval (over prompts) of the candidate's acceptance rate over the
    reference's; None without per-prompt counts (a server's /metrics totals) or when undefined."""
    if ref.per_request is None or cand.per_request is None or len(ref.per_request) != len(cand.per_request):
        return None
    pairs = [tuple(x) for x in ref.per_request], [tuple(x) for x in cand.per_request]
    ci = paired_ratio_bootstrap(*pairs, seed=seed)
    return None if ci is None else list(ci)


def generation(gen: GenerationRecord, reference: GenerationRecord | None, ngram: int) -> dict[str, Any]:
    """Repetition of ``gen`` and (against ``reference``) where it first diverges."""
    shares = [repeated_ngram_share(t, ngram) for t in gen.tokens]
    loops = [longest_loop(t) for t in gen.tokens]
    out: dict[str, Any] = {
        "repeated_ngram_share": sum(shares) / len(shares),
        "longest_loop": max(loops),
        "per_prompt_repeated_ngram_share": shares,
        "per_prompt_longest_loop": loops,
        "seconds": gen.seconds,
    }
    if reference is not None:
        firsts = [first_divergence(r, t) for r, t in zip(reference.tokens, gen.tokens, strict=True)]
        lengths = [len(t) for t in gen.tokens]
        # A prompt that never diverges counts with its full length (a lower bound of its divergence).
        counted = [n if f is None else f for f, n in zip(firsts, lengths, strict=True)]
        out["first_divergence"] = firsts
        out["first_divergence_mean"] = sum(counted) / len(counted)
        out["identical_generations"] = sum(f is None for f in firsts)
    return out


def _ops(v: VariantRecord, operands: dict[str, dict[str, float]]) -> dict[str, Any]:
    theory = theory_for(next(iter(v.schemes))) if len(v.schemes) == 1 else None
    out: dict[str, Any] = {"theory_bmm_rel_err": None}
    if theory is not None:
        out["theory_bmm_rel_err"] = theory.product
        if operands:  # the Gaussian theory scaled by each layer's alignment gain (theory.alignment_gain)
            out["theory_bmm_rel_err_aligned"] = {
                "q_absorption": fmean(theory.aligned(o["gain_uk"]) for o in operands.values()),
                "v_up_projection": fmean(theory.aligned(o["gain_uv"]) for o in operands.values()),
            }
    if not v.ops:
        return out
    acts_uk = [o.act_uk for o in v.ops if o.act_uk is not None]
    acts_uv = [o.act_uv for o in v.ops if o.act_uv is not None]
    out["bmm_rel_err"] = {
        "q_absorption": fmean(o.bmm_uk for o in v.ops),
        "v_up_projection": fmean(o.bmm_uv for o in v.ops),
    }
    out["weight_rel_err"] = {
        "w_uk": fmean(o.weight_uk for o in v.ops),
        "w_uv": fmean(o.weight_uv for o in v.ops),
    }
    out["activation_rel_err"] = {
        "x_uk": fmean(acts_uk) if acts_uk else None,
        "x_uv": fmean(acts_uv) if acts_uv else None,
    }
    out["ops_by_layer"] = [
        {
            "layer": o.layer,
            "w_uk": o.weight_uk,
            "w_uv": o.weight_uv,
            "x_uk": o.act_uk,
            "x_uv": o.act_uv,
            "bmm_uk": o.bmm_uk,
            "bmm_uv": o.bmm_uv,
            "theory_uk": None if theory is None else theory.aligned(operands[str(o.layer)]["gain_uk"]),
            "theory_uv": None if theory is None else theory.aligned(operands[str(o.layer)]["gain_uv"]),
        }
        for o in v.ops
    ]
    return out


def kld_stats(v: VariantRecord, buckets: list[list[int]]) -> dict[str, Any]:
    """llama.cpp's ``--kl-divergence`` list over every predicted position, and by position bucket."""
    import numpy as np

    def flat(name: str) -> np.ndarray:
        return np.array([x for w in v.per_token[name] for x in w], dtype=np.float64)

    positions = np.array([t for w in v.per_token["kl"] for t in range(len(w))], dtype=np.int64)
    edges = [b[0] for b in buckets] + [buckets[-1][1]]
    return kld_statistics_by_bucket(
        positions, edges, flat("kl"), flat("delta_p"), flat("top1"), flat("nll_delta")
    )


def decode_summary(per_token: dict[str, list[list[float]]]) -> dict[str, Any]:
    """KL and top-1 on the decode path: generated positions whose context both sides still share."""
    import numpy as np

    kl = np.array([x for w in per_token["decode_kl"] for x in w], dtype=np.float64)
    if kl.size == 0:
        return {"n": 0}
    top1 = np.array([x for w in per_token["decode_top1"] for x in w], dtype=np.float64)
    out = {"n": int(kl.size), "kld": distribution(kl, KLD_QUANTILES)}
    out["top1_agreement"] = float(top1.mean())
    out["kl_estimator"] = estimator_summary(per_token["decode_mass_outside"], per_token["decode_exact"])
    return out


def variant_summary(
    v: VariantRecord, reference: VariantRecord | None, r: Record, derived: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One variant's figures; ``reference`` None for the reference itself."""
    out: dict[str, Any] = {
        "name": v.name,
        "kind": v.kind,
        "dtype": v.dtype,
        "schemes": dict(v.schemes),
        "description": "; ".join(f"{k}: {d}" for k, d in v.schemes.items()),
        **_ops(v, r.operands),
    }
    p = v.positions
    if reference is None:
        if "nll" in p:
            per, overall = bucket_mean(p["nll"])
            out["nll"], out["nll_by_bucket"] = overall, per
    else:
        layers = []
        for x in v.layers:
            per, overall = ratio_rms(p[f"attn_diff2/{x.layer}"], p[f"attn_ref2/{x.layer}"])
            layers.append({"layer": x.layer, "mtp": x.mtp, "rel_err": overall, "by_bucket": per})
        if layers:
            out["attn_rel_err"] = fmean(x["rel_err"] for x in layers)
            out["attn_rel_err_by_bucket"] = mean_of_lists([x["by_bucket"] for x in layers])
            out["attn_rel_err_by_layer"] = layers
        for key, name in (("kl", "kl"), ("top1_agreement", "top1"), ("nll_delta", "nll_delta")):
            if name in p:
                per, overall = bucket_mean(p[name])
                out[key], out[f"{key}_by_bucket"] = overall, per
    if reference is not None and v.per_token.get("decode_kl") is not None:
        out["decode"] = decode_summary(v.per_token)
    if reference is not None and v.per_token.get("kl"):
        out["kld_stats"] = kld_stats(v, r.buckets)
        if "mass_outside" in v.per_token:  # a top-k estimate (a server source)
            out["kl_estimator"] = estimator_summary(v.per_token["mass_outside"], v.per_token["exact"])
    if reference is not None and v.per_token.get("mc_ref_logprob"):
        out["mc_kl"] = mc_kl.summary(v.per_token, r.seed)
    gen = v.generation
    out.update(acceptance(gen.spec if gen else None))
    ref_spec = None if reference is None or reference.generation is None else reference.generation.spec
    if gen is not None and gen.spec is not None and ref_spec is not None:
        out["acceptance_ratio_ci"] = acceptance_ratio_ci(ref_spec, gen.spec, r.seed)
    if gen is not None:
        ref_gen = None if reference is None else reference.generation
        out["generation"] = generation(gen, ref_gen, r.config["ngram"])
        out["sample"] = gen.sample
    out.update(derived if derived is not None else variant_task_figures(v, reference, r))
    out["seconds"] = v.seconds
    return out


def _suite(r: Record) -> dict[str, Any] | None:
    if r.tasks is None:
        return None
    return {
        "config": dict(r.tasks.config),
        "haystack": dict(r.tasks.haystack),
        "samples": len(r.tasks.samples),
        "seconds": r.tasks.seconds,
        # which samples: every variant's "task_outcomes" is aligned with this list (``mlaq compare``)
        "items": [
            {
                "task": s.task,
                "length": s.length,
                "index": s.index,
                "depth": s.depth,
                "fingerprint": s.fingerprint,
            }
            for s in r.tasks.samples
        ],
    }


def summarize(r: Record, verdict_config: VerdictConfig | None = None) -> Report:
    """The whole report, typed and frozen (``Report.to_json``: what ``--json`` prints, report.json holds)."""
    vc = verdict_config or VerdictConfig()
    everyone = [r.reference, *([r.noise_floor] if r.noise_floor else []), *r.candidates]
    derived = {id(v): variant_task_figures(v, None if v is r.reference else r.reference, r) for v in everyone}

    def summary_of(v: VariantRecord) -> dict[str, Any]:
        return variant_summary(v, None if v is r.reference else r.reference, r, derived[id(v)])

    reference = summary_of(r.reference)
    noise_floor = None if r.noise_floor is None else summary_of(r.noise_floor)
    cands = {v.name: summary_of(v) for v in r.candidates if v.kind != "as_configured"}
    as_configured = None
    for v in r.candidates:
        if v.kind == "as_configured":
            as_configured = summary_of(v)
            as_configured["decisions"] = list(v.decisions)
    suite, vc_json = _suite(r), vc.to_json()
    for summary in [*cands.values(), *([as_configured] if as_configured else [])]:
        summary["verdict"] = verdict(summary, reference, r.config["prompts"], vc)
    return Report.from_json(
        {
            "format_version": FORMAT_VERSION,
            "source": r.source,
            "model": dict(r.model),
            "eval_text": dict(r.eval_text),
            "config": dict(r.config),
            "seed": r.seed,
            "versions": dict(r.versions),
            "buckets": [list(b) for b in r.buckets],
            "reference": reference,
            "noise_floor": noise_floor,
            "schemes": cands,
            "as_configured": as_configured,
            "theory": {
                name: {
                    "weight": t.weight,
                    "activation": t.activation,
                    "output": t.output,
                    "product": t.product,
                    "note": t.note,
                }
                for name, t in THEORY.items()
            },
            "operands": {k: dict(v) for k, v in sorted(r.operands.items(), key=lambda kv: int(kv[0]))},
            "tasks": suite,
            "verdict_config": vc_json,
            "timings": dict(r.timings),
        }
    )

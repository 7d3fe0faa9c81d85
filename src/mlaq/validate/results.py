"""Turn the raw measurements into the report's JSON object (the one ``--json`` prints)."""

from __future__ import annotations

import platform
import sys
from statistics import fmean
from typing import TYPE_CHECKING, Any

import torch

import mlaq
from mlaq.validate.generation import acceptance_json, generation_json
from mlaq.validate.theory import THEORY, theory_for

if TYPE_CHECKING:
    from mlaq.validate.runner import Measured, VariantRun

FORMAT_VERSION = 1


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _versions() -> dict[str, str]:
    out = {"mlaq": mlaq.__version__, "torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        import tokenizers

        out["tokenizers"] = tokenizers.__version__
    except ImportError:  # pragma: no cover - the tokenizer could not have loaded
        pass
    out["platform"] = platform.platform()
    out["machine"] = platform.machine()
    return out


def _mean_of_lists(rows: list[list[float | None]]) -> list[float | None]:
    """Element-wise mean over rows, skipping None."""
    out: list[float | None] = []
    for col in zip(*rows, strict=True):
        vals = [v for v in col if v is not None]
        out.append(fmean(vals) if vals else None)
    return out


def _common(run: VariantRun, operands: dict[int, dict[str, float]]) -> dict[str, Any]:
    v = run.variant
    out: dict[str, Any] = {
        "name": v.name,
        "kind": v.kind.value,
        "dtype": _dtype(v.dtype),
        "schemes": dict(run.descriptions),
        "description": "; ".join(f"{k}: {d}" for k, d in run.descriptions.items()),
        "theory_bmm_rel_err": None,
    }
    theory = theory_for(next(iter(run.descriptions))) if len(run.descriptions) == 1 else None
    if theory is not None:
        out["theory_bmm_rel_err"] = theory.product
        # the Gaussian theory scaled by each layer's alignment gain (see theory.alignment_gain)
        out["theory_bmm_rel_err_aligned"] = {
            "q_absorption": fmean(theory.aligned(o["gain_uk"]) for o in operands.values()),
            "v_up_projection": fmean(theory.aligned(o["gain_uv"]) for o in operands.values()),
        }
    if run.ops:
        out["bmm_rel_err"] = {
            "q_absorption": fmean(o.bmm_uk for o in run.ops),
            "v_up_projection": fmean(o.bmm_uv for o in run.ops),
        }
        out["weight_rel_err"] = {
            "w_uk": fmean(o.weight_uk for o in run.ops),
            "w_uv": fmean(o.weight_uv for o in run.ops),
        }
        acts_uk = [o.act_uk for o in run.ops if o.act_uk is not None]
        acts_uv = [o.act_uv for o in run.ops if o.act_uv is not None]
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
                "theory_uk": None if theory is None else theory.aligned(operands[o.layer]["gain_uk"]),
                "theory_uv": None if theory is None else theory.aligned(operands[o.layer]["gain_uv"]),
            }
            for o in run.ops
        ]
    return out


def _candidate(
    run: VariantRun, reference: VariantRun, ngram: int, operands: dict[int, dict[str, float]]
) -> dict[str, Any]:
    out = _common(run, operands)
    sums = run.sums
    layers = []
    for layer, mtp in sorted(run.layers.items()):
        per, overall = sums.ratio_rms(f"attn_diff2/{layer}", f"attn_ref2/{layer}")
        layers.append({"layer": layer, "mtp": mtp, "rel_err": overall, "by_bucket": per})
    out["attn_rel_err"] = fmean(x["rel_err"] for x in layers)
    out["attn_rel_err_by_bucket"] = _mean_of_lists([x["by_bucket"] for x in layers])
    out["attn_rel_err_by_layer"] = layers
    for key, name in (("kl", "kl"), ("top1_agreement", "top1"), ("nll_delta", "nll_delta")):
        per, overall = sums.mean(name)
        out[key], out[f"{key}_by_bucket"] = overall, per
    out.update(acceptance_json(run.generation.stats if run.generation else None))
    if run.generation is not None:
        out["generation"] = generation_json(run.generation, reference.generation, ngram)
        out["sample"] = run.sample
    out["seconds"] = run.seconds
    return out


def _reference(run: VariantRun, ngram: int, operands: dict[int, dict[str, float]]) -> dict[str, Any]:
    out = _common(run, operands)
    per, overall = run.sums.mean("nll")
    out["nll"], out["nll_by_bucket"] = overall, per
    out.update(acceptance_json(run.generation.stats if run.generation else None))
    if run.generation is not None:
        out["generation"] = generation_json(run.generation, None, ngram)
        out["sample"] = run.sample
    out["seconds"] = run.seconds
    return out


def assemble(m: Measured) -> dict[str, Any]:
    """The whole report as one JSON-ready dict."""
    c, mc, data = m.config, m.model_config, m.data
    ops = m.operands
    cands = {r.variant.name: _candidate(r, m.reference, c.ngram, ops) for r in m.candidates}
    as_configured = None
    if c.as_configured:
        from mlaq.validate.config import AS_CONFIGURED

        as_configured = cands.pop(AS_CONFIGURED)
        as_configured["decisions"] = m.decisions
    return {
        "format_version": FORMAT_VERSION,
        "model": {
            "path": str(c.model),
            "model_type": mc.model_type,
            "num_hidden_layers": mc.num_hidden_layers,
            "num_mtp_layers": m.num_mtp_layers,
            "num_attention_heads": mc.num_attention_heads,
            "kv_lora_rank": mc.kv_lora_rank,
            "qk_nope_head_dim": mc.qk_nope_head_dim,
            "qk_rope_head_dim": mc.qk_rope_head_dim,
            "v_head_dim": mc.v_head_dim,
            "max_position_embeddings": mc.max_position_embeddings,
            "checkpoint_dtype": str(mc.hf.get("torch_dtype") or mc.hf.get("dtype") or "bfloat16"),
        },
        "eval_text": {
            "path": str(data.path),
            "sha256": data.sha256,
            "bytes": data.num_bytes,
            "tokens": len(data.tokens),
            "window_starts": list(data.window_starts),
            "prompt_starts": list(data.prompt_starts),
            "prompt_sample": m.prompt_sample,
        },
        "config": {
            "schemes": list(c.schemes),
            "as_configured": c.as_configured,
            "settings": c.settings.to_json() if c.as_configured else None,
            "quantization_config": c.quantization_config,
            "precision": c.precision.value,
            "context_len": data.context_len,
            "windows": len(data.window_starts),
            "buckets": m.buckets.count,
            "prompts": c.prompts,
            "prompt_len": c.prompt_len,
            "max_tokens": c.max_tokens,
            "num_speculative_tokens": c.num_speculative_tokens,
            "ngram": c.ngram,
            "threads": torch.get_num_threads(),
        },
        "seed": c.seed,
        "versions": _versions(),
        "buckets": [list(r) for r in m.buckets.ranges()],
        "reference": _reference(m.reference, c.ngram, ops),
        "noise_floor": None
        if m.noise_floor is None
        else _candidate(m.noise_floor, m.reference, c.ngram, ops),
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
        "operands": {str(k): v for k, v in sorted(m.operands.items())},
        "timings": m.timings,
    }

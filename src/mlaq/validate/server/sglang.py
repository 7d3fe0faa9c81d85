"""SGLang's native API, where its OpenAI API falls short: its OpenAI ``top_logprobs`` are keyed by token
text, which cannot compare two servers exactly, so teacher forcing and greedy generation use ``/generate``
with token ids. Shapes read from the sglang 0.5.23 wheel:

- ``GET /server_info`` (``/get_server_info`` is its deprecated name; srt/entrypoints/http_server.py
  ``server_info``): the resolved server arguments (``context_length``, ``speculative_algorithm``,
  ``speculative_num_draft_tokens``...), the scheduler's ``max_total_num_tokens`` / ``max_req_input_len``,
  ``version``. SGLang 0.5.23 has no ``/version`` route.
- ``POST /generate`` (``generate_request``) with ``input_ids``, ``sampling_params``, ``return_logprob``,
  ``logprob_start_len``, ``top_logprobs_num``, ``return_text_in_logprobs``; the answer is
  ``{"text", "output_ids", "meta_info"}``. In ``meta_info`` (srt/managers/tokenizer_manager.py
  ``detokenize_logprob_tokens`` / ``detokenize_top_logprobs_tokens``): ``input_token_logprobs`` is a list
  of ``[logprob, token_id, text|null]`` from ``logprob_start_len`` on (the first prompt token's logprob is
  null); ``input_top_logprobs`` a list of such lists (null where there is no prediction);
  ``output_token_logprobs`` / ``output_top_logprobs`` the same for generated tokens. Errors: HTTP 400
  ``{"error": "<contract violation>"}`` or ``{"error": {"message": ...}}``.
- Speculative decoding per request (``_calculate_spec_decoding_metrics``): ``spec_verify_ct`` (verification
  steps), ``spec_num_proposed_drafts`` (draft tokens), ``spec_num_correct_drafts`` (accepted drafts),
  ``spec_accept_length``, ``spec_accept_rate``; no per-position counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlaq.validate.server.client import ServerError
from mlaq.validate.server.protocol import Greedy, TeacherForced

SERVER_INFO = ("/server_info", "/get_server_info")
TEACHER_FORCING = "SGLang /generate (input_token_logprobs, input_top_logprobs)"
GENERATION = "SGLang /generate (output_ids, output_top_logprobs)"
ACCEPTANCE = "SGLang /generate meta_info (spec_verify_ct, spec_num_proposed_drafts, spec_num_correct_drafts)"


@dataclass(frozen=True)
class SglangInfo:
    """What /server_info says about the deployment."""

    version: str
    context_length: int | None  # the resolved --context-length (the model's when not given)
    max_total_num_tokens: int | None  # KV-cache capacity
    speculative_algorithm: str | None


def sglang_info(body: Any) -> SglangInfo | None:
    """The server-info answer of an SGLang server, or None when ``body`` is not one."""
    if not isinstance(body, Mapping) or "version" not in body or "max_total_num_tokens" not in body:
        return None

    def num(key: str) -> int | None:
        v = body.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    algo = body.get("speculative_algorithm")
    return SglangInfo(str(body["version"]), num("context_length"), num("max_total_num_tokens"), algo or None)


def generate_body(
    tokens: Sequence[int], max_new_tokens: int, k: int, *, prompt_logprobs: bool
) -> dict[str, Any]:
    """A greedy ``/generate`` request on token ids, with top-``k`` log-probabilities keyed by id."""
    if k < 1:
        raise ServerError(
            f"--logprobs {k}: SGLang's /generate returns the top top_logprobs_num >= 1 only (no whole "
            "distribution); pass --logprobs K"
        )
    return {
        "input_ids": list(tokens),
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 0 if prompt_logprobs else -1,
        "top_logprobs_num": k,
        "return_text_in_logprobs": False,
    }


def _meta(response: Any) -> Mapping[str, Any]:
    meta = response.get("meta_info") if isinstance(response, Mapping) else None
    if not isinstance(meta, Mapping):
        raise ServerError(f"SGLang /generate answered without meta_info: {str(response)[:200]}")
    return meta


def _top_map(entry: Any) -> dict[int, float]:
    """``[[logprob, token_id, text], ...]`` -> {token_id: logprob}."""
    out: dict[int, float] = {}
    for item in entry or ():
        lp, tid = item[0], item[1]
        out[int(tid)] = float("-inf") if lp is None else float(lp)
    return out


def parse_teacher_forced(response: Any, tokens: Sequence[int]) -> TeacherForced:
    """Per prompt position t >= 1, the distribution that predicted ``tokens[t]`` (logprob_start_len 0)."""
    meta = _meta(response)
    itl, itop = meta.get("input_token_logprobs"), meta.get("input_top_logprobs")
    n = len(tokens)
    if not isinstance(itl, list) or not isinstance(itop, list) or len(itl) != n or len(itop) != n:
        got = len(itl) if isinstance(itl, list) else None
        raise ServerError(
            f"SGLang /generate returned {got} input token logprobs for a prompt of {n} tokens (logprob_start_len 0)"
        )
    values, top = [], []
    for t in range(1, n):
        lp, tid = itl[t][0], int(itl[t][1])
        if tid != tokens[t]:
            raise ServerError(f"SGLang /generate scored token {tid} at prompt position {t}, not {tokens[t]}")
        v = float("-inf") if lp is None else float(lp)
        d = _top_map(itop[t])
        d.setdefault(tid, v)
        values.append(v)
        top.append(d)
    return TeacherForced(tuple(tokens), np.array(values, dtype=np.float64), tuple(top))


def spec_metrics(meta: Mapping[str, Any]) -> dict[str, Any] | None:
    """SGLang's per-request speculative counters in the shape ``spec.per_request_stats`` reads."""
    steps = meta.get("spec_verify_ct")
    if not isinstance(steps, int) or steps <= 0:
        return None
    drafts = int(meta.get("spec_num_proposed_drafts", 0))
    return {
        "speculative_decoding": {
            "num_spec_steps": steps,
            "num_draft_tokens": drafts,
            "num_accepted_draft_tokens": int(meta.get("spec_num_correct_drafts", 0)),
            "num_spec_tokens": drafts // steps,
        }
    }


def parse_greedy(response: Any) -> Greedy:
    """The generated ids, their top-k maps, and the request's speculative counters."""
    meta = _meta(response)
    ids = response.get("output_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ServerError(f"SGLang /generate answered without output_ids: {str(response)[:200]}")
    tops = meta.get("output_top_logprobs")
    top = tuple(_top_map(e) for e in tops) if isinstance(tops, list) and len(tops) == len(ids) else None
    return Greedy(tuple(ids), spec_metrics(meta), top=top)

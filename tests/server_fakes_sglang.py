"""A fake SGLang 0.5.23 server on ``server_fakes``' machinery (same toy model, same switches): the routes
and answer shapes of SGLang's source (srt/entrypoints/http_server.py: ``/server_info``, ``/get_server_info``,
``/generate``, no ``/version``; srt/managers/tokenizer_manager.py: ``meta_info``'s ``[logprob, token_id,
text]`` triples and ``spec_*`` counters), and its OpenAI API keying top logprobs by token text."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from server_fakes import Behaviour, FakeServer, _Handler, _top, logprobs


@dataclass
class SglangBehaviour(Behaviour):
    text_keys: bool = True  # SGLang's OpenAI top_logprobs are keyed by token text
    prompt_logprobs: bool = False  # no vLLM prompt_logprobs
    generate_requests: int = 0
    completions_requests: int = 0


def _triples(lp: np.ndarray, k: int) -> list[list[Any]]:
    return [[v, t, None] for t, v in _top(lp, k, None).items()]


class _SglangHandler(_Handler):
    def do_GET(self) -> None:
        b: SglangBehaviour = self.server.behaviour
        if self.path == "/v1/models":
            card = {"id": b.name, "object": "model", "created": 0, "owned_by": "sglang", "root": b.name}
            return self._send(200, {"object": "list", "data": [{**card, "max_model_len": b.max_model_len}]})
        if self.path in ("/server_info", "/get_server_info"):
            return self._send(
                200,
                {
                    "model_path": b.name,
                    "context_length": b.max_model_len,
                    "speculative_algorithm": "EAGLE" if b.spec_k else None,
                    "speculative_num_draft_tokens": b.spec_k + 1 if b.spec_k else None,
                    "max_total_num_tokens": 4096,
                    "max_req_input_len": b.max_model_len - 1,
                    "internal_states": [{}],
                    "version": "0.5.23",
                    "frontend": "python",
                },
            )
        self._send(404, {"detail": "Not Found"})  # FastAPI's answer: no /version, /metrics without metrics

    def do_POST(self) -> None:
        b: SglangBehaviour = self.server.behaviour
        if self.path == "/v1/completions":
            b.completions_requests += 1
            return super().do_POST()
        if self.path == "/tokenize":
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            tokens = [ord(ch) % 32 for ch in body["prompt"]]
            return self._send(200, {"tokens": tokens, "count": len(tokens), "max_model_len": b.max_model_len})
        if self.path != "/generate":
            return self._send(404, {"detail": "Not Found"})
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            return self._send(400, {"error": "input_ids: expected a list of integers"})
        b.generate_requests += 1
        self._send(200, self._generate(b, body, ids))

    def _generate(self, b: SglangBehaviour, body: dict[str, Any], prompt: list[int]) -> dict[str, Any]:
        n = body.get("sampling_params", {}).get("max_new_tokens", 128)
        seq, out = list(prompt), []
        for _ in range(n):
            out.append(int(np.argmax(logprobs(seq, b.noise))))
            seq.append(out[-1])
        meta: dict[str, Any] = {
            "id": f"req-{b.generate_requests}",
            "finish_reason": {"type": "length", "length": n},
            "prompt_tokens": len(prompt),
            "weight_version": "default",
            "num_retractions": 0,
            "completion_tokens": n,
            "cached_tokens": 0,
        }
        if body.get("return_logprob"):
            k = body.get("top_logprobs_num", 0)
            start = body.get("logprob_start_len", -1)
            start = len(prompt) - 1 if start == -1 else start
            meta["input_token_logprobs"] = [
                [None if i == 0 else float(logprobs(prompt[:i], b.noise)[prompt[i]]), prompt[i], None]
                for i in range(start, len(prompt))
            ]
            meta["output_token_logprobs"] = [
                [float(logprobs(seq[:i], b.noise)[seq[i]]), seq[i], None]
                for i in range(len(prompt), len(seq))
            ]
            meta["output_token_logprobs_length"] = n
            if k > 0:
                meta["input_top_logprobs"] = [
                    None if i == 0 else _triples(logprobs(prompt[:i], b.noise), k)
                    for i in range(start, len(prompt))
                ]
                meta["output_top_logprobs"] = [
                    _triples(logprobs(seq[:i], b.noise), k) for i in range(len(prompt), len(seq))
                ]
        if b.spec_k and n > 1:
            spec = self._spec(b, n)  # the machinery's acceptance pattern, translated to SGLang's counters
            steps = (
                b.counters["num_drafts"] if spec is None else spec["speculative_decoding"]["num_spec_steps"]
            )
            if spec is None:
                raise AssertionError("SglangBehaviour needs per_request=True with spec_k")
            acc = spec["speculative_decoding"]["num_accepted_draft_tokens"]
            meta.update(
                spec_accept_rate=acc / (steps * b.spec_k),
                spec_accept_length=n / steps,
                spec_num_correct_drafts=acc,
                spec_num_proposed_drafts=steps * b.spec_k,
                spec_verify_ct=steps,
            )
        return {"text": "".join(chr(65 + t) for t in out), "output_ids": out, "meta_info": meta}


class SglangServer(FakeServer):
    """``with SglangServer(SglangBehaviour(...)) as url: ...``"""

    def __init__(self, behaviour: SglangBehaviour | None = None) -> None:
        super().__init__(behaviour or SglangBehaviour())
        self.httpd.RequestHandlerClass = _SglangHandler

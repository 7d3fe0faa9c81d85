"""A live OpenAI-compatible server as a measurement target: teacher-forced log-probs, greedy
continuations, tokenization, identity and metrics.

What the server can do is probed once (``probe``), with a two-token request, so a server that lacks a
capability fails fast with one clear message instead of after minutes of work. Requests carry token
ids, never text, so both servers of an A/B see exactly the same input.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlaq.validate.server import sglang
from mlaq.validate.server.client import ClientConfig, HttpClient, ServerError, Unsupported
from mlaq.validate.server.protocol import (
    NO_LOGPROBS,
    Greedy,
    TeacherForced,
    parse_echo_logprobs,
    parse_greedy_ids,
    parse_greedy_top,
    parse_prompt_logprobs,
)
from mlaq.validate.server.spec import Counters, counters, parse_prometheus

FULL = -1  # --logprobs -1: the whole distribution (vLLM: needs --max-logprobs -1)


@dataclass
class Identity:
    """Who answered: written into the report's header."""

    url: str
    model: str
    max_model_len: int | None
    version: str | None
    teacher_forcing: str | None = None  # "prompt_logprobs" | "echo" | None (unsupported)
    metrics: bool = False  # /metrics answers
    spec_decode_counters: bool = False  # /metrics carries vllm:spec_decode_* counters
    notes: list[str] = field(default_factory=list)
    kind: str = "openai"  # "sglang": its native /generate carries teacher forcing and generation
    apis: dict[str, str] = field(default_factory=dict)  # measurement -> the API that answered it

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class ServerTarget:
    """One server. ``model``: the served model name (default: the first of /v1/models)."""

    def __init__(
        self,
        config: ClientConfig,
        *,
        model: str | None = None,
        tokenizer: Path | None = None,
        note: Callable[[str], None] | None = None,
    ) -> None:
        self.client = HttpClient(config, note)
        self._model = model
        self._tokenizer_path = tokenizer
        self._local_tokenizer: Any = None
        self._tf_mode: str | None = None
        self._extras = True  # the server accepts vLLM's extra request fields
        self.ids_from: str | None = None  # who made the token ids sent (named when the server refuses them)
        self.identity: Identity | None = None

    def close(self) -> None:
        self.client.close()

    # -- identity -------------------------------------------------------------------------------
    def probe(self) -> Identity:
        """Read /v1/models, /version and /metrics (the latter two optional)."""
        models = self.client.get_json("/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        if not data:
            raise ServerError(f"{self.client.config.base}/v1/models lists no model")
        names = [m.get("id") for m in data]
        if self._model is None:
            self._model = names[0]
        elif self._model not in names:
            raise ServerError(
                f"model {self._model!r} is not served at {self.client.config.base} (it serves: "
                f"{', '.join(map(str, names))}); fix --model"
            )
        entry = data[names.index(self._model)]
        version = None
        with contextlib.suppress(ServerError):  # /version is optional (SGLang 0.5.23 has none)
            version = str(self.client.get_json("/version").get("version"))
        info = self._sglang_info() if version is None else None
        max_len = entry.get("max_model_len") or (info.context_length if info else None)
        ident = Identity(self.client.config.base, self._model, max_len, info.version if info else version)
        if info is not None:
            ident.kind = "sglang"
            ident.teacher_forcing = self._tf_mode = sglang.TEACHER_FORCING
            ident.apis = {"teacher_forcing": sglang.TEACHER_FORCING, "generation": sglang.GENERATION}
            if info.speculative_algorithm:
                ident.apis["acceptance"] = sglang.ACCEPTANCE
        try:
            c = self.scrape()
            ident.metrics, ident.spec_decode_counters = True, c.has_spec
        except ServerError:
            ident.notes.append("no /metrics endpoint: MTP acceptance only from per-request metrics")
        self.identity = ident
        return ident

    def _sglang_info(self) -> sglang.SglangInfo | None:
        """The server's SGLang info (the server kind is decided here, once), or None: not SGLang."""
        for path in sglang.SERVER_INFO:
            try:
                return sglang.sglang_info(self.client.get_json(path))
            except ServerError:
                continue
        return None

    @property
    def sglang(self) -> bool:
        return self.identity is not None and self.identity.kind == "sglang"

    @property
    def model(self) -> str:
        if self._model is None:
            raise RuntimeError("probe() first")
        return self._model

    def scrape(self) -> Counters:
        return counters(parse_prometheus(self.client.get("/metrics").text), self._model)

    # -- tokenization ---------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens): the server's /tokenize, else --tokenizer."""
        if self._local_tokenizer is None:
            try:
                r = self.client.post_json(
                    "/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False}
                )
                return [int(t) for t in r["tokens"]]
            except ServerError as exc:
                if exc.status not in (400, 404, 405, 501):
                    raise
                self._local_tokenizer = self._load_tokenizer(exc)
        return list(self._local_tokenizer.encode(text, add_special_tokens=False))

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens`` for the report's samples: /detokenize, else --tokenizer, else ""."""
        if self._local_tokenizer is None:
            try:
                r = self.client.post_json("/detokenize", {"model": self.model, "tokens": list(tokens)})
                return str(r.get("prompt", ""))
            except ServerError:
                if self._tokenizer_path is None:
                    return ""
                self._local_tokenizer = self._load_tokenizer(ServerError("no /detokenize"))
        return str(self._local_tokenizer.decode(list(tokens)))

    def _load_tokenizer(self, exc: ServerError) -> Any:
        if self._tokenizer_path is None:
            raise Unsupported(
                f"{self.client.config.base} has no /tokenize ({exc}); pass --tokenizer PATH "
                "(a checkpoint directory with tokenizer.json)"
            ) from None
        from mlaq.engine.tokenizer import Tokenizer

        p = self._tokenizer_path
        return Tokenizer.from_dir(p.parent if p.name == "tokenizer.json" else p)

    # -- teacher forcing ------------------------------------------------------------------------
    def teacher_forced(self, tokens: list[int], k: int) -> TeacherForced:
        """Per position of ``tokens``, the distribution of the next token (top ``k``, or full)."""
        if len(tokens) < 2:
            raise ValueError("teacher forcing needs at least 2 tokens")
        self.probe_teacher_forcing(k)
        if self.sglang:
            body = sglang.generate_body(tokens, 1, k, prompt_logprobs=True)
            return sglang.parse_teacher_forced(self.client.post_json("/generate", body), tokens)
        if self._tf_mode == "prompt_logprobs":
            r = self._completion(tokens, max_tokens=1, prompt_logprobs=k)
            parsed = parse_prompt_logprobs(r, tokens)
            if parsed is None:
                raise Unsupported(NO_LOGPROBS)
            return parsed
        r = self._completion(tokens, max_tokens=1, echo=True, logprobs=k, return_tokens_as_token_ids=True)
        return parse_echo_logprobs(r, tokens)

    def probe_teacher_forcing(self, k: int) -> str:
        """Which request shape returns prompt log-probs (probed once); Unsupported when none does."""
        if self._tf_mode is None:
            self._tf_mode = self._probe_teacher_forcing(k)
            if self.identity is not None:
                self.identity.teacher_forcing = self._tf_mode
        return self._tf_mode

    def _probe_teacher_forcing(self, k: int) -> str:
        probe = [0, 1]
        try:
            r = self._completion(probe, max_tokens=1, prompt_logprobs=k)
            if parse_prompt_logprobs(r, probe) is not None:
                return "prompt_logprobs"
        except Unsupported:
            raise
        except ServerError as exc:
            if exc.status != 400:
                raise
        r = self._completion(probe, max_tokens=1, echo=True, logprobs=k, return_tokens_as_token_ids=True)
        parse_echo_logprobs(r, probe)  # raises Unsupported with the reason
        return "echo"

    # -- generation -----------------------------------------------------------------------------
    def greedy(self, prompt: list[int], max_tokens: int, k: int = 1) -> Greedy:
        """Greedy completion of ``prompt`` (EOS ignored, so every prompt yields ``max_tokens``), with
        the top-``k`` distribution of every generated token."""
        if self.sglang:
            body = sglang.generate_body(prompt, max_tokens, k, prompt_logprobs=False)
            return sglang.parse_greedy(self.client.post_json("/generate", body))
        extras = {"logprobs": k, "return_tokens_as_token_ids": True, "return_token_ids": True}
        r = self._completion(prompt, max_tokens=max_tokens, ignore_eos=True, **extras)
        ids, text = parse_greedy_ids(r)
        metrics = r.get("metrics") if isinstance(r, dict) else None
        top = parse_greedy_top(r)
        if ids is not None:
            return Greedy(ids, metrics, top=top if top is not None and len(top) == len(ids) else None)
        return Greedy(tuple(self.tokenize(text)), metrics, ids_from_text=True)

    def sample(self, prompt: list[int], max_tokens: int, seed: int) -> tuple[int, ...]:
        """A continuation of ``prompt`` drawn at temperature 1 (no top-k / top-p truncation, EOS ignored):
        the tokens the Monte-Carlo KL scores on both sides."""
        extras = {"logprobs": 1, "return_tokens_as_token_ids": True, "return_token_ids": True}
        r = self._completion(
            prompt, max_tokens=max_tokens, ignore_eos=True, temperature=1.0, top_p=1.0, seed=seed, **extras
        )
        ids, _ = parse_greedy_ids(r)
        if ids is None:
            raise Unsupported(
                "the reference returned no token ids for a sampled continuation: the Monte-Carlo KL needs "
                "them (vLLM: return_token_ids or return_tokens_as_token_ids)"
            )
        return ids

    def _completion(self, prompt: list[int], **fields: Any) -> Any:
        try:
            return self._complete(prompt, **fields)
        except ServerError as exc:
            words = ("outside the vocabulary", "out of vocabulary", "out-of-vocab", "out of vocab")
            if self.ids_from is None or not any(w in str(exc).lower() for w in words):
                raise
            raise ServerError(
                f"{exc}; the token ids were made by {self.ids_from}: most likely another model's tokenizer "
                "(give --tokenizer of the served model, or compare servers of the same model)",
                exc.status,
            ) from None

    def _complete(self, prompt: list[int], **fields: Any) -> Any:
        body = {"model": self.model, "prompt": prompt, "temperature": 0.0, **fields}
        if self._extras:
            try:
                return self.client.post_json("/v1/completions", body)
            except ServerError as exc:
                # a server that rejects vLLM's extra fields: retry once with the OpenAI fields only
                if exc.status != 400 or not any(f in str(exc) for f in _EXTRAS):
                    raise
                self._extras = False
        plain = {k: v for k, v in body.items() if k not in _EXTRAS}
        return self.client.post_json("/v1/completions", plain)


_EXTRAS = ("return_tokens_as_token_ids", "return_token_ids", "ignore_eos")

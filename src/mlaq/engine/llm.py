"""``mlaq.LLM``: vLLM's offline API (``LLM(model).generate(prompts, SamplingParams)``) over mlaq's engine.

>>> llm = LLM("path/to/checkpoint", speculative_config={"method": "mtp", "num_speculative_tokens": 3})
>>> out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
>>> out[0].outputs[0].text
>>> print(llm.spec_decoding_stats.log_line())   # vLLM's "SpecDecoding metrics: ..." line

``generate`` is the folded ``generate_stream``: one code path for both.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from mlaq.engine.config import CompilationConfig, resolve_dtype
from mlaq.engine.engine import EngineConfig, LLMEngine
from mlaq.engine.model_api import LatentLM
from mlaq.engine.outputs import RequestOutput, fold
from mlaq.engine.sampling_params import SamplingParams, as_params_list
from mlaq.engine.spec_metrics import SpecDecodingStats
from mlaq.engine.tokenizer import Tokenizer

Prompt = str | Mapping[str, Any]  # text, {"prompt": text} or {"prompt_token_ids": [...]}


class LLM:
    """A model plus an engine. ``model`` is a checkpoint directory or a ready ``LatentLM``.

    ``compile=True``: decode, verification and MTP steps run through ``torch.compile`` (see
    ``mlaq.engine.compiled``; mlaq's own DeepSeek models without DSA only). Off by default.
    ``compilation_config``: vLLM's JSON, of which compile=True takes ``{"inductor_compile_config":
    {"max_autotune": true}}`` (``mlaq.engine.config.CompilationConfig``).
    ``max_num_batched_tokens``: prompt tokens prefilled together in one step (vLLM's; at least
    ``max_model_len``; default ``max_model_len``: vLLM-CPU's MLA default is max(max_model_len, 2048))."""

    def __init__(
        self,
        model: str | Path | LatentLM,
        *,
        tokenizer: Tokenizer | None = None,
        dtype: str | torch.dtype | None = None,
        quantization_config: str | None = None,
        quantization: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_dtype: str = "auto",
        speculative_config: str | Mapping[str, Any] | None = None,
        seed: int = 0,
        eos_token_ids: Sequence[int] | None = None,
        compile: bool = False,
        compilation_config: str | Mapping[str, Any] | None = None,
    ) -> None:
        limit = None
        dtype = resolve_dtype(dtype)  # a torch dtype or vLLM's names ("bfloat16", "auto", ...)
        if isinstance(model, (str, Path)):
            from mlaq.engine.adapter import load_latent_lm  # the model layer, only when loading
            from mlaq.policy.explicit import policy_config  # vLLM's meaning under quantization="online"

            qc = policy_config(quantization_config, quantization)
            loaded = load_latent_lm(Path(model), dtype=dtype, quantization_config=qc)
            model, limit = loaded.model, loaded.max_position_embeddings
            tokenizer = tokenizer or loaded.tokenizer
            eos_token_ids = eos_token_ids if eos_token_ids is not None else loaded.eos_token_ids
        if compilation_config is not None and not compile:
            raise ValueError("compilation_config applies to compile=True (--compile); pass both or neither")
        if compile:
            model = _compiled(model, CompilationConfig.parse(compilation_config))
        if eos_token_ids is None:
            eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else ()
        if max_model_len is None:
            # vLLM takes the model's limit; a CPU emulator needs a cache that fits in memory.
            max_model_len = min(limit or 4096, 4096)
        elif limit is not None and max_model_len > limit:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}"
            )
        config = EngineConfig(
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            kv_cache_dtype=kv_cache_dtype,
            speculative_config=speculative_config,
            seed=seed,
            max_position_embeddings=limit,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        self.tokenizer = tokenizer
        self.engine = LLMEngine(model, config, tokenizer, eos_token_ids)

    @property
    def spec_decoding_stats(self) -> SpecDecodingStats | None:
        """Acceptance counters over every request so far (None without speculative decoding)."""
        return self.engine.spec_decoding_stats

    def _add(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[str]:
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        prompts = list(prompts)
        plist = as_params_list(params if params is not None else SamplingParams(), len(prompts))
        ids = []
        for prompt, p in zip(prompts, plist, strict=True):
            text, token_ids = self._tokens(prompt)
            ids.append(self.engine.add_request(token_ids, p, text))
        return ids

    def _tokens(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt", "")
        if not isinstance(prompt, str):
            raise ValueError(
                f"a prompt is text or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}"
            )
        if self.tokenizer is None:
            raise ValueError(
                "text prompts need a tokenizer (tokenizer.json); pass {'prompt_token_ids': [...]}"
            )
        return prompt, self.tokenizer.encode(prompt)

    def generate_stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield deltas (new text and tokens of one request) as the engine produces them."""
        self._add(prompts, sampling_params)
        return self._run()

    def _run(self) -> Iterator[RequestOutput]:
        while self.engine.has_unfinished_requests:
            yield from self.engine.step()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs in prompt order (the folded stream)."""
        ids = self._add(prompts, sampling_params)
        deltas: dict[str, list[RequestOutput]] = {i: [] for i in ids}
        for delta in self._run():
            deltas[delta.request_id].append(delta)
        return [fold(deltas[i]) for i in ids]

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling_params: SamplingParams | None = None,
    ) -> RequestOutput:
        """One conversation through the checkpoint's chat template."""
        if self.tokenizer is None:
            raise ValueError("chat needs the checkpoint's tokenizer")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.generate({"prompt": text, "prompt_token_ids": ids}, sampling_params)[0]


def _compiled(model: LatentLM, compilation: CompilationConfig) -> LatentLM:
    from mlaq.engine.adapter import DeepseekLatentLM
    from mlaq.engine.compiled import CompiledLatentLM

    if not isinstance(model, DeepseekLatentLM):
        raise ValueError(f"compile=True needs one of mlaq's DeepSeek models, got {type(model).__name__}")
    if isinstance(model, CompiledLatentLM):
        if compilation != CompilationConfig():
            raise ValueError("compilation_config: this model is compiled already; build it with max_autotune")
        return model
    return CompiledLatentLM(model.model, max_autotune=compilation.max_autotune)

"""The in-memory engine as a measurement source: every variant of one checkpoint, run here, into a Record.

Order of work (one model per dtype stays loaded; schemes are re-prepared in place):
1. per teacher-forcing window: the reference run captures every layer's attention input and the
   reference log-probabilities; then each variant runs (a) the whole window teacher-forced with the
   absorbed (decode) path -> KL, top-1, NLL change by position, and (b) each layer's attention on the
   captured inputs -> relative error by layer and position; on the first window also the per-op
   error of both BMMs;
2. per variant: greedy generation from the prompts, speculative with k MTP drafts when k >= 1.
"""

from __future__ import annotations

import time

from mlaq.model.config import ModelConfig
from mlaq.policy import decide_from_dir
from mlaq.validate.config import NOISE_FLOOR, REFERENCE, ValidateConfig, Variant
from mlaq.validate.generation import generate
from mlaq.validate.inputs import eval_text_info, local_inputs
from mlaq.validate.progress import NullProgress, Progress
from mlaq.validate.record import GenerationRecord, Record, SpecCounts
from mlaq.validate.sources import common
from mlaq.validate.sources import windows as windows_source
from mlaq.validate.sources.windows import Run
from mlaq.validate.tasks import run as tasks
from mlaq.validate.variants import ModelPool


class EngineSource:
    """Loads the checkpoint once per dtype and measures every variant in this process."""

    name = "engine"

    def __init__(
        self,
        config: ValidateConfig,
        *,
        reference: Variant = REFERENCE,
        noise_floor: Variant | None = NOISE_FLOOR,
    ) -> None:
        self.config, self.reference, self.noise_floor = config, reference, noise_floor

    def measure(self, progress: Progress | None = None) -> Record:
        progress = progress or NullProgress()
        config, reference, shape = self.config, self.reference, self.config.shape
        t0 = time.perf_counter()
        model_config = ModelConfig.from_dir(config.model)
        if config.as_configured:  # a bad --quantization-config fails now, not after minutes of work
            decide_from_dir(config.model, config.settings, config.policy_config(), log=False)
        context = config.resolve_context(model_config.max_position_embeddings)
        needed = shape.prompt_len + shape.max_tokens + config.num_speculative_tokens
        if needed > context:
            most = model_config.max_position_embeddings
            raise ValueError(
                f"--prompt-len {shape.prompt_len} + --max-tokens {shape.max_tokens} (+ k drafts) = {needed} "
                f"tokens do not fit the context of {context}; shorten them"
                + (f" or raise --context-len (the model takes up to {most})" if most > context else "")
            )
        candidates = config.variants(reference)
        inputs = local_inputs(config, context, model_config.max_position_embeddings)
        tokenizer, data, buckets, drawn = inputs.tokenizer, inputs.data, inputs.buckets, inputs.drawn
        others = ([self.noise_floor] if self.noise_floor is not None else []) + list(candidates)
        runs = {v: Run(v) for v in [reference, *others]}
        pool = ModelPool(config)
        if config.num_speculative_tokens and pool.model(reference).num_mtp_layers == 0:
            raise ValueError(
                f"{config.model} has no MTP layer weights, so MTP speculative decoding cannot run; "
                "pass --num-speculative-tokens 0"
            )
        timings = {"load_and_tokenize": time.perf_counter() - t0}
        windows = data.windows()
        task_variants = [reference, *candidates]  # the fp32 noise floor would need its own prefill
        progress.begin(
            len(windows) * (1 + len(others)) + 1 + len(others) + (tasks.steps(drawn) if drawn else 0)
        )
        ok = False
        try:
            t1 = time.perf_counter()
            operands = windows_source.teacher_forced(
                pool, runs, reference, others, windows, buckets, progress, config.flip_rows
            )
            timings["teacher_forced_and_per_layer"] = time.perf_counter() - t1
            t2 = time.perf_counter()
            prompts = data.prompts()
            for v in [reference, *others]:
                k = config.num_speculative_tokens
                progress.step(f"{v.name}: greedy generation" + (f", MTP k={k}" if k else ""))
                start = time.perf_counter()
                gen = generate(
                    pool.model(v),
                    prompts,
                    max_tokens=shape.max_tokens,
                    num_speculative_tokens=k,
                    max_model_len=context,
                    seed=shape.seed,
                )
                s = gen.stats
                runs[v].generation = GenerationRecord(
                    [list(t) for t in gen.tokens],
                    gen.seconds,
                    None
                    if s is None
                    else SpecCounts(
                        s.num_drafts,
                        s.num_draft_tokens,
                        s.num_accepted_tokens,
                        list(s.num_accepted_tokens_per_pos),
                        None if gen.per_request is None else [list(x) for x in gen.per_request],
                    ),
                    tokenizer.decode(gen.tokens[0]),
                )
                runs[v].seconds += time.perf_counter() - start
            timings["generation"] = time.perf_counter() - t2
            if drawn is not None:
                t3 = time.perf_counter()
                scores = tasks.score(
                    drawn.samples, drawn.suite, pool, task_variants, config.precision, progress
                )
                for v, sc in scores.items():
                    runs[v].tasks = sc
                timings["tasks"] = time.perf_counter() - t3
            ok = True
        finally:
            progress.end(ok)
        timings["total"] = time.perf_counter() - t0
        decisions = pool.decisions()
        num_mtp = pool.model(reference).num_mtp_layers
        return Record(
            model=common.model_info(config, model_config, num_mtp),
            eval_text=eval_text_info(data, tokenizer.decode(prompts[0][-48:])),
            config=common.config_info(config, data, buckets.count),
            seed=shape.seed,
            versions=common.versions(),
            buckets=[list(r) for r in buckets.ranges()],
            reference=runs[reference].freeze(decisions),
            noise_floor=None if self.noise_floor is None else runs[self.noise_floor].freeze(decisions),
            candidates=[runs[v].freeze(decisions) for v in candidates],
            operands={str(k): v for k, v in sorted(operands.items())},
            timings=timings,
            source=self.name,
            tasks=None if drawn is None else drawn.record(timings.get("tasks", 0.0)),
        )

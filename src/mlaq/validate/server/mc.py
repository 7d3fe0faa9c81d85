"""``--mc-kl N``: continuations sampled from the reference server at temperature 1, then the same token
ids scored teacher-forced on both servers, for the Monte-Carlo KL of ``mlaq.validate.mc_kl``.

Continuation i starts from prompt i mod P (the run's greedy prompts) with its own seed, and is
``max_tokens`` long. Scoring asks each server for its top-``--logprobs`` distribution at every position
(the chosen token's log-probability is always included), so with ``--logprobs -1`` the exact KL at the
same positions comes out beside the estimate.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from mlaq.validate.progress import Progress
from mlaq.validate.server.client import Unsupported
from mlaq.validate.server.config import ServerValidateConfig
from mlaq.validate.server.sides import Inputs, Side
from mlaq.validate.server.target import ServerTarget

Pmap = Callable[[Callable[[Any], Any], Sequence[Any], int, Progress, str], list[Any]]


def steps(cfg: ServerValidateConfig, sides: int) -> int:
    """Progress steps: the samples, then every side's scoring."""
    return cfg.mc_kl * (1 + sides) if cfg.mc_kl else 0


def sample_and_score(
    cfg: ServerValidateConfig,
    reference: ServerTarget,
    targets: list[tuple[ServerTarget, Side]],
    inputs: Inputs,
    progress: Progress,
    pmap: Pmap,
) -> None:
    """Fill every side's ``mc`` / ``mc_start`` (or its ``errors["mc_kl"]`` when a server cannot)."""
    if not cfg.mc_kl or not inputs.prompts:
        return
    start = time.perf_counter()
    prompts = [inputs.prompts[i % len(inputs.prompts)] for i in range(cfg.mc_kl)]
    jobs = [(p, cfg.shape.seed * 1_000_003 + i) for i, p in enumerate(prompts)]
    try:
        drawn = pmap(
            lambda job: reference.sample(job[0], inputs.max_tokens, job[1]),
            jobs,
            cfg.concurrency,
            progress,
            f"{reference.model}: sampled continuation",
        )
    except Unsupported as exc:
        for _, side in targets:
            side.errors["mc_kl"] = str(exc)
        return
    sequences = [[*p, *x] for p, x in zip(prompts, drawn, strict=True)]
    for target, side in targets:
        try:
            side.mc = pmap(
                lambda seq, t=target: t.teacher_forced(seq, cfg.logprobs),
                sequences,
                cfg.concurrency,
                progress,
                f"{target.model}: scoring sampled continuation",
            )
            side.mc_start = [len(p) for p in prompts]
        except Unsupported as exc:
            side.errors["mc_kl"] = str(exc)
        side.seconds["mc_kl"] = time.perf_counter() - start

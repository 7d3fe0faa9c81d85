"""The long-context task suite through live servers: the same samples (drawn from the evaluation text
with the server's tokenizer), the same two scores as the engine's suite.

Per sample and server:
- exact match: the greedy continuation of the prompt (``len(answer)`` tokens) equals the answer. Its
  first token comes from the prefill, every later one from the decode path (the absorbed BMMs), each
  predicted after the correct answer prefix for as long as the answer is being reproduced: exactly
  greedy decoding reproducing the answer;
- mean log-probability of the answer tokens and the share of answer tokens that are their position's
  argmax, teacher-forced through the server's prompt log-probabilities (the prefill path: under vLLM's
  design it does not run the absorbed BMMs, see the report's decode-path section).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mlaq.validate.record import TaskScoreRecord, TaskSuiteRecord
from mlaq.validate.server.client import Unsupported
from mlaq.validate.server.sides import Inputs, Side, Tokenizing
from mlaq.validate.tasks import run as suite_run
from mlaq.validate.tasks.generators import TaskSample
from mlaq.validate.tasks.haystack import Haystack
from mlaq.validate.tasks.scoring import score_answer
from mlaq.validate.tasks.spec import TaskConfig

if TYPE_CHECKING:
    from mlaq.validate.progress import Progress
    from mlaq.validate.server.config import ServerValidateConfig
    from mlaq.validate.server.target import ServerTarget


@dataclass
class Suite:
    config: TaskConfig
    haystack: Haystack
    samples: list[TaskSample]
    skipped: list[str]
    seconds: float = 0.0

    def record(self) -> TaskSuiteRecord:
        return suite_run.suite_record(self.config, self.haystack, self.samples, self.skipped, self.seconds)


def draw_samples(cfg: ServerValidateConfig, inputs: Inputs, cand: ServerTarget, max_len: int | None) -> Suite:
    """The samples, drawn before any measuring (a length beyond the servers' context fails now)."""
    tasks = cfg.shape.tasks
    assert tasks is not None
    # teacher forcing sends prompt + answer and asks one more token: lengths up to max_model_len - 1
    limit = max_len - 1 if max_len else 4096
    suite = suite_run.resolve(tasks, limit, f"the server {cand.model} (max_model_len - 1)")
    haystack = Haystack(str(inputs.eval_text.get("path")), tuple(inputs.text_tokens))
    encode = Tokenizing(cand, cfg.tokenizer).encode
    samples, skipped = suite_run.draw(suite, haystack, encode, explicit=tasks.lengths is not None)
    return Suite(suite, haystack, samples, skipped)


def score(
    cfg: ServerValidateConfig, suite: Suite, target: ServerTarget, side: Side, progress: Progress
) -> None:
    """Both scores of every sample on one server, into ``side.tasks`` (an error note when it cannot)."""
    start = time.perf_counter()
    n = len(suite.samples)
    with ThreadPoolExecutor(max_workers=cfg.concurrency) as ex:
        greedy = list(ex.map(lambda s: target.greedy(list(s.prompt), len(s.answer), 1), suite.samples))
        for i in range(n):
            progress.step(f"{target.model}: task greedy {i + 1}/{n}")
        try:
            forced = list(ex.map(lambda s: target.teacher_forced(s.ids, 1), suite.samples))
        except Unsupported as exc:
            side.errors["tasks"] = f"answer log-probabilities: {exc}"
            forced = None
        for i in range(n):
            progress.step(f"{target.model}: task teacher-forced {i + 1}/{n}")
    out = []
    for k, s in enumerate(suite.samples):
        tf = forced[k] if forced is not None else None
        if tf is None:  # no answer log-probabilities: exact match only
            out.append(TaskScoreRecord(tuple(greedy[k].tokens) == tuple(s.answer), 0.0, 0.0))
            continue
        logprobs, argmax = _answer_positions(s, tf)
        out.append(score_answer(s, logprobs, argmax, greedy=greedy[k].tokens))
    side.tasks = out
    suite.seconds += time.perf_counter() - start
    side.seconds["tasks"] = time.perf_counter() - start


def _answer_positions(s: TaskSample, tf: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The answer tokens' log-probabilities and each answer position's most likely token (ties: the
    lower id) from a server's teacher-forced prompt log-probabilities."""
    first = len(s.prompt) - 1  # the prompt position that predicts the first answer token
    rows = range(first, first + len(s.answer))
    logprobs = torch.tensor([float(tf.token_logprobs[i]) for i in rows], dtype=torch.float64)
    argmax = torch.tensor([max(tf.top[i], key=lambda t, i=i: (tf.top[i][t], -t)) for i in rows])
    return logprobs, argmax

"""The four task generators. Each draws one sample of exactly ``length`` tokens (prompt + answer).

Layout: haystack filler with fact lines inserted at depths (fraction of the filler before the line:
0 = the very start, 1 = right before the query), then the query, then the answer. A sample is
redrawn (new keys, values and haystack offset) if the answer's ids occur anywhere else in the prompt.
- needle: one ``key = value`` line at a chosen depth; ``assert key ==`` -> value.
- multikey: ``pairs`` dict entries ``table["key"] = value`` spread evenly (jittered) through the
  context, one queried: the associative recall of Zoology's MQAR among many competing keys.
- copy: ``name = "<segment>"`` with a segment of >= copy_tokens tokens of random words, placed in the
  first quarter of the context; ``assert name == "`` -> the whole segment.
- vartrack: ``chains`` chains of ``hops`` assignments (``a = 48213``, ``b = a``, ``c = b`` ...) spread in
  order through the context; the last variable of one chain is queried -> the first one's value.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from mlaq.validate.tasks.haystack import Haystack, count, find
from mlaq.validate.tasks.spec import TaskConfig
from mlaq.validate.tasks.surface import Encode, distinct, identifier, line, number, query_and_answer, word

_ATTEMPTS = 32


class TooShort(ValueError):
    """A length that cannot hold a task's facts, query and answer."""


@dataclass(frozen=True)
class TaskSample:
    """One sample: ``prompt`` then ``answer``, ``length`` tokens in all."""

    task: str
    length: int
    index: int
    depth: float  # where the answer's fact sits in the filler (0 start, 1 end)
    prompt: tuple[int, ...]
    answer: tuple[int, ...]
    query_start: int  # index in prompt where the query begins: the decode path runs from here
    fact_start: int  # index in prompt of the answer's one occurrence in the context
    wrapped: bool  # the haystack text was repeated to fill the sample

    @property
    def ids(self) -> list[int]:
        return [*self.prompt, *self.answer]


@dataclass(frozen=True)
class _Draft:
    """A task's facts before layout: (depth, ids) lines, the query, the answer, which line holds it."""

    lines: list[tuple[float, list[int]]]
    query: list[int]
    answer: list[int]
    answer_line: int
    depth: float


def _needle(rng: random.Random, encode: Encode, cfg: TaskConfig, index: int) -> _Draft | None:
    key, value = identifier(rng), number(rng)
    fact = line(encode, f"{key} = {value}")
    qa = query_and_answer(encode, f"assert {key} ==", f" {value}", fact)
    depth = cfg.depths[index % len(cfg.depths)]
    return None if qa is None else _Draft([(depth, fact)], qa[0], qa[1], 0, depth)


def _multikey(rng: random.Random, encode: Encode, cfg: TaskConfig, index: int) -> _Draft | None:
    keys = distinct(rng, cfg.pairs, identifier)
    values = distinct(rng, cfg.pairs, number)
    facts = [line(encode, f'table["{k}"] = {v}') for k, v in zip(keys, values, strict=True)]
    depths = [(i + rng.random()) / cfg.pairs for i in range(cfg.pairs)]
    q = rng.randrange(cfg.pairs)
    qa = query_and_answer(encode, f'assert table["{keys[q]}"] ==', f" {values[q]}", facts[q])
    if qa is None:
        return None
    return _Draft(list(zip(depths, facts, strict=True)), qa[0], qa[1], q, depths[q])


def _copy(rng: random.Random, encode: Encode, cfg: TaskConfig, index: int) -> _Draft | None:
    name = identifier(rng)
    words: list[str] = []
    qa = None
    while qa is None or len(qa[1]) < cfg.copy_tokens:
        words += [word(rng, rng.randrange(1, 4)) for _ in range(8)]
        segment = " ".join(words)
        fact = line(encode, f'{name} = "{segment}"')
        qa = query_and_answer(encode, f'assert {name} == "', segment, fact)
        if qa is None:
            return None
    depth = rng.uniform(0.0, 0.25)
    return _Draft([(depth, fact)], qa[0], qa[1], 0, depth)


def _vartrack(rng: random.Random, encode: Encode, cfg: TaskConfig, index: int) -> _Draft | None:
    names = distinct(rng, cfg.chains * cfg.hops, identifier)
    values = distinct(rng, cfg.chains, number)
    chains = [names[c * cfg.hops : (c + 1) * cfg.hops] for c in range(cfg.chains)]
    texts: list[tuple[int, str]] = []  # (chain, assignment), hop by hop so every chain reads in order
    for hop in range(cfg.hops):
        order = list(range(cfg.chains))
        rng.shuffle(order)
        for c in order:
            rhs = values[c] if hop == 0 else chains[c][hop - 1]
            texts.append((c, f"{chains[c][hop]} = {rhs}"))
    slots = len(texts)
    depths = [(i + rng.random()) / slots for i in range(slots)]
    facts = [line(encode, t) for _, t in texts]
    q = rng.randrange(cfg.chains)
    first = next(i for i, (c, _) in enumerate(texts) if c == q)  # the line holding the value
    qa = query_and_answer(encode, f"assert {chains[q][-1]} ==", f" {values[q]}", facts[first])
    if qa is None:
        return None
    return _Draft(list(zip(depths, facts, strict=True)), qa[0], qa[1], first, depths[first])


GENERATORS: dict[str, Callable[[random.Random, Encode, TaskConfig, int], _Draft | None]] = {
    "needle": _needle,
    "multikey": _multikey,
    "copy": _copy,
    "vartrack": _vartrack,
}


def make_sample(
    task: str, length: int, index: int, cfg: TaskConfig, haystack: Haystack, encode: Encode
) -> TaskSample:
    """Sample ``index`` of ``task`` at ``length`` tokens: deterministic in (cfg.seed, task, length, index)."""
    for attempt in range(_ATTEMPTS):
        rng = random.Random(f"mlaq-tasks/{cfg.seed}/{task}/{length}/{index}/{attempt}")
        draft = GENERATORS[task](rng, encode, cfg, index)
        if draft is None:
            continue
        fixed = sum(len(ids) for _, ids in draft.lines) + len(draft.query) + len(draft.answer)
        filler_len = length - fixed
        if filler_len < 0:
            raise TooShort(
                f"--lengths {length} is too short for task {task}: its facts, query and answer alone take "
                f"{fixed} tokens; use lengths of at least {2 * fixed}"
            )
        filler = haystack.take(rng.randrange(len(haystack)), filler_len)
        prompt, starts = _lay_out(filler, draft.lines)
        fact_start = starts[draft.answer_line] + find(draft.answer, draft.lines[draft.answer_line][1])
        query_start = len(prompt)
        prompt += draft.query
        if count(draft.answer, prompt) != 1:  # the filler or another fact holds it too: redraw
            continue
        return TaskSample(
            task,
            length,
            index,
            draft.depth,
            tuple(prompt),
            tuple(draft.answer),
            query_start,
            fact_start,
            haystack.wraps(filler_len),
        )
    raise ValueError(
        f"could not draw a {task} sample of {length} tokens in {_ATTEMPTS} attempts: the tokenizer merges "
        "the answer with its surroundings, or the haystack contains the answers; try another --eval-text"
    )


def _lay_out(filler: list[int], lines: list[tuple[float, list[int]]]) -> tuple[list[int], list[int]]:
    """Insert each line at round(depth * len(filler)) of the filler -> (tokens, start of each line)."""
    n = len(filler)
    order = sorted(range(len(lines)), key=lambda i: (lines[i][0], i))
    out: list[int] = []
    starts = [0] * len(lines)
    done = 0
    for i in order:
        cut = max(done, min(n, round(lines[i][0] * n)))
        out += filler[done:cut]
        done = cut
        starts[i] = len(out)
        out += lines[i][1]
    out += filler[done:]
    return out, starts


def build_samples(cfg: TaskConfig, haystack: Haystack, encode: Encode) -> list[TaskSample]:
    """Every sample of the suite: task by task, length by length, ``cfg.samples_of(task)`` each."""
    return [
        make_sample(task, length, i, cfg, haystack, encode)
        for task in cfg.tasks
        for length in cfg.lengths
        for i in range(cfg.samples_of(task))
    ]

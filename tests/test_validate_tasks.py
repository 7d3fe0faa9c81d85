"""The long-context task generators: exact layout, determinism, wrap-around, clear errors."""

from __future__ import annotations

import pytest

from mlaq.validate.tasks.generators import TaskSample, build_samples, make_sample
from mlaq.validate.tasks.haystack import Haystack, count, find
from mlaq.validate.tasks.spec import (
    TaskConfig,
    default_lengths,
    parse_depths,
    parse_ints,
    parse_samples,
    parse_tasks,
)

TEXT = "".join(f"def f{i % 23}(x, y={i % 7}):\n    return x * {i % 11} + y\n" for i in range(400))


def encode(text: str) -> list[int]:  # a character-level tokenizer: every id is a code point
    return [ord(c) for c in text]


def decode(ids) -> str:
    return "".join(chr(i) for i in ids)


HAY = Haystack("test", tuple(encode(TEXT)))


def _check(s: TaskSample, decode=decode) -> None:
    assert len(s.ids) == s.length == len(s.prompt) + len(s.answer)
    assert count(s.answer, s.prompt) == 1, "the answer must occur exactly once in the prompt"
    assert list(s.prompt[s.fact_start : s.fact_start + len(s.answer)]) == list(s.answer)
    assert find(s.answer, s.prompt) == s.fact_start < s.query_start
    assert decode(s.prompt[s.query_start :]).startswith("\nassert ")


@pytest.mark.parametrize("task", ["needle", "multikey", "copy", "vartrack"])
def test_answer_present_exactly_once(task) -> None:
    cfg = TaskConfig(tasks=(task,), lengths=(1200, 3000), samples=5)
    samples = build_samples(cfg, HAY, encode)
    assert len(samples) == 10
    for s in samples:
        _check(s)
    answers = {s.answer for s in samples}
    assert len(answers) == len(samples), "fresh values per sample"


def test_needle_sits_at_its_depth() -> None:
    cfg = TaskConfig(tasks=("needle",), lengths=(4000,), samples=5, depths=(0.0, 0.25, 0.5, 0.75, 1.0))
    samples = build_samples(cfg, HAY, encode)
    assert [s.depth for s in samples] == [0.0, 0.25, 0.5, 0.75, 1.0]
    for s in samples:
        key = decode(s.prompt[s.query_start :]).split()[1]  # "\nassert KEY =="
        line = f"\n{key} ={decode(s.answer)}\n"
        start = s.fact_start - len(f"\n{key} =")  # the fact line's first token
        assert decode(s.prompt[start : start + len(line)]) == line
        filler = s.query_start - len(line)  # haystack tokens around the line
        assert start == round(s.depth * filler), (s.depth, start, filler)


def test_copy_segment_is_long_and_early() -> None:
    cfg = TaskConfig(tasks=("copy",), lengths=(2000,), samples=4)
    for s in build_samples(cfg, HAY, encode):
        assert len(s.answer) >= 64 and s.depth <= 0.25
        assert s.fact_start < 0.3 * s.length


def test_multikey_has_16_pairs_and_vartrack_chains() -> None:
    s = make_sample("multikey", 2000, 0, TaskConfig(), HAY, encode)
    assert decode(s.prompt).count('\ntable["') == 16
    v = make_sample("vartrack", 2000, 0, TaskConfig(hops=4, chains=2), HAY, encode)
    text = decode(v.prompt)
    queried = text[v.query_start :].split()[1]
    # follow the chain back from the queried name to its value
    assignments = dict(
        line.split(" = ")
        for line in text.splitlines()
        if line.count(" = ") == 1 and "_" in line.split(" = ")[0] and " " not in line.split(" = ")[0]
    )
    name, hops = queried, 0
    while not assignments[name].isdigit():
        name, hops = assignments[name], hops + 1
    assert hops == 3 and assignments[name] == decode(v.answer).strip()


def test_deterministic_by_seed() -> None:
    cfg = TaskConfig(lengths=(1500,), samples=3)
    a, b = build_samples(cfg, HAY, encode), build_samples(cfg, HAY, encode)
    assert a == b
    c = build_samples(TaskConfig(lengths=(1500,), samples=3, seed=1), HAY, encode)
    assert [s.answer for s in a] != [s.answer for s in c]


def test_short_haystack_wraps_around() -> None:
    short = Haystack("short", tuple(encode("x = 1\ny = 2\n")))
    s = make_sample("needle", 500, 0, TaskConfig(), short, encode)
    _check(s)
    assert s.wrapped and not make_sample("needle", 500, 0, TaskConfig(), HAY, encode).wrapped
    assert short.take(10, 30) == [short.tokens[(10 + i) % len(short)] for i in range(30)]


def test_bpe_tokenizer_of_the_bundled_model() -> None:
    """The same properties hold with a real BPE tokenizer (whatever model is bundled)."""
    pytest.importorskip("tokenizers")
    from mlaq.engine.tokenizer import Tokenizer
    from mlaq.validate.config import bundled_model_dir

    try:
        path = bundled_model_dir()
    except FileNotFoundError:
        pytest.skip("no bundled model in this checkout")
    tok = Tokenizer.from_dir(path)

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    hay = Haystack("t", tuple(enc(TEXT)))
    for s in build_samples(TaskConfig(lengths=(1024,), samples=3), hay, enc):
        _check(s, lambda ids: tok.decode(list(ids)))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: parse_tasks("needle,haystack"), "unknown task 'haystack'; known tasks: needle"),
        (lambda: parse_tasks("needle,needle"), "listed twice"),
        (lambda: parse_depths("0,1.5"), "depth 1.5 is outside [0, 1]"),
        (lambda: parse_depths("-0.1"), "outside [0, 1]"),
        (lambda: parse_depths("a"), "expected numbers in [0, 1]"),
        (lambda: parse_ints("--lengths", "512,x"), "comma-separated integers"),
        (lambda: parse_ints("--lengths", "0"), "positive integers"),
        (lambda: TaskConfig(samples=0), "--task-samples must be at least 1, got 0"),
        (lambda: TaskConfig(pairs=8), "at least 16 key-value pairs"),
        (lambda: parse_samples("many"), "expected a number such as 20 or per task"),
        (lambda: parse_samples("needle=32,hay=4"), "unknown task 'hay'"),
        (lambda: parse_samples("needle=x"), "'needle=x' needs a whole number"),
        (lambda: TaskConfig(per_task=(("needle", 0),)), "--task-samples must be at least 1"),
        (lambda: TaskConfig(lengths=(512, 8192)).check_context(2048, "m"), "exceed m's context of 2048"),
        (lambda: make_sample("multikey", 300, 0, TaskConfig(), HAY, encode), "too short for task multikey"),
        (lambda: Haystack("empty.txt", ()), "haystack empty.txt is empty"),
    ],
)
def test_bad_inputs(call, message) -> None:
    with pytest.raises(ValueError) as err:
        call()
    assert message in str(err.value)


def test_samples_per_task() -> None:
    assert parse_samples("20") == (20, ())
    samples, per = parse_samples("needle=64,copy=8")
    cfg = TaskConfig(samples=samples, per_task=per)
    assert [cfg.samples_of(t) for t in ("needle", "multikey", "copy", "vartrack")] == [64, 30, 8, 2]
    drawn = build_samples(
        TaskConfig(tasks=("needle", "copy"), lengths=(1500,), per_task=(("copy", 2),), samples=3), HAY, encode
    )
    assert [s.task for s in drawn] == ["needle"] * 3 + ["copy"] * 2


def test_default_lengths_follow_the_context() -> None:
    assert default_lengths(2048) == (2048,)
    assert default_lengths(163840) == (4096,)  # capped: CPU emulation
    assert default_lengths(256) == (256,)

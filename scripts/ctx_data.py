"""Corpus and long-context training tasks for mlaq-tiny-4k.

Natural text comes from two kinds of source, each with a held-out part never trained on:
- code: this Python's standard library (.py), minus the held-out modules of tiny_data.HELDOUT
  (held-out text: their source, `heldout.txt`, as for mlaq-tiny);
- prose: the Linux kernel's Documentation (Debian package `linux-doc`, reStructuredText);
  held-out prose is a different source altogether, the Python tutorial and FAQ (Debian package
  `python3.11-doc`, `heldout-prose.txt`), so evaluation haystacks are text of a kind and an author
  the model never saw.

Training windows mix that natural text with procedurally generated retrieval tasks embedded in it
(`make_window`): key -> value facts queried later (needle / many keys), long repeated segments (copy),
and chains of assignments (variable tracking). Keys and values are fresh random strings per window, so a
model can only answer from its context. Everything is deterministic given the numpy Generator passed in.
"""

from __future__ import annotations

import gzip
import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tiny_data import HELDOUT, document, split_corpus, stdlib_dir
from tokenizers import Tokenizer

KERNEL_DOCS = Path("/usr/share/doc/linux-doc/Documentation")
PY_DOCS = Path("/usr/share/doc/python3.11/html/_sources")
HELDOUT_PROSE_DIRS = ("tutorial", "faq")  # of PY_DOCS


def code_texts() -> tuple[list[str], str]:
    """(training documents, held-out text) from the standard library source."""
    root = stdlib_dir()
    train, held = split_corpus(root, ".py", HELDOUT, tests=True)
    return [document(root, p) for p in train], "".join(document(root, p) for p in held)


def _read(p: Path) -> str:
    data = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
    return data.decode("utf-8", errors="replace")


def prose_texts(max_bytes: int, root: Path = KERNEL_DOCS) -> list[str]:
    """Documentation files (*.rst.gz or *.rst, sorted: deterministic), up to max_bytes in all."""
    if not root.is_dir():
        raise SystemExit(f"{root} not found: `apt-get install linux-doc` (the prose corpus)")
    out, total = [], 0
    for p in sorted([*root.rglob("*.rst.gz"), *root.rglob("*.rst")]):
        text = _read(p)
        out.append(f"{text}\n")
        total += len(out[-1])
        if total >= max_bytes:
            break
    return out


def heldout_prose(root: Path = PY_DOCS) -> str:
    """The Python tutorial and FAQ sources: English prose with examples, never trained on."""
    if not root.is_dir():
        raise SystemExit(f"{root} not found: `apt-get install python3.11-doc` (held-out prose)")
    files = sorted(p for d in HELDOUT_PROSE_DIRS for p in (root / d).rglob("*.rst.txt"))
    return "".join(p.read_text(encoding="utf-8", errors="replace") + "\n" for p in files)


# ---------------------------------------------------------------- random keys and values
_CONS, _VOW = "bcdfghjklmnprstvwz", "aeiou"


def word(rng: np.random.Generator, syllables: int) -> str:
    return "".join(_CONS[rng.integers(len(_CONS))] + _VOW[rng.integers(len(_VOW))] for _ in range(syllables))


def random_key(rng: np.random.Generator) -> str:
    """An identifier no corpus contains: 2-3 pseudo-words, sometimes with digits."""
    parts = [word(rng, int(rng.integers(1, 4))) for _ in range(int(rng.integers(2, 4)))]
    if rng.random() < 0.3:
        parts.append(str(int(rng.integers(10, 1000))))
    return "_".join(parts)


def random_value(rng: np.random.Generator) -> str:
    if rng.random() < 0.7:
        return str(int(rng.integers(10 ** int(rng.integers(2, 6)), 10**7)))
    return word(rng, int(rng.integers(2, 5)))


# Fact families: a fact template and the ways it is queried later. A query is its template cut just
# before "{v}" (the model must complete the value); {d} is a random container name per window.
FORMS = (
    ("{k} = {v}", ("{k} = {v}", "assert {k} == {v}", "print({k})  # {v}")),
    ('{d}["{k}"] = {v}', ('{d}["{k}"] = {v}', 'assert {d}["{k}"] == {v}', '{d}.get("{k}")  # {v}')),
    ("    '{k}': {v},", ("    '{k}': {v},", "assert {d}['{k}'] == {v}")),
    ('{k}: "{v}"', ('{k}: "{v}"',)),
    ("The value of {k} is {v}.", ("The value of {k} is {v}.", "So {k} is {v}.")),
    ("set {k} to {v}", ("set {k} to {v}",)),
    ("{k} -> {v}", ("{k} -> {v}",)),
)


def split_query(template: str, rng: np.random.Generator, enc, **kw: str) -> tuple[list[int], list[int]]:
    """A query line's (ids, answer mask). The answer is the value with the space before it (" 48213", as
    the task suite splits ``assert k ==`` + `` 48213``). Half the time the line is tokenized whole, half
    as prompt + answer: the two ways an evaluator may split it. The mask marks the answer's ids."""
    text = template.format(**kw) + "\n"
    cut = template.index("{v}")
    if cut and template[cut - 1] == " ":
        cut -= 1
    cut = len(template[:cut].format(**kw))
    end = len(text) - 1 - len(template[template.index("{v}") + 3 :].format(**kw))  # value ends here
    head = enc(text[:cut])
    if rng.random() < 0.5:
        ids = enc(text)
        shared = 0
        while shared < min(len(ids), len(head)) and ids[shared] == head[shared]:
            shared += 1
        tail = len(enc(text[end:]))  # the ids after the value (closing quote, newline ...), roughly
        return ids, [0] * shared + [1] * max(0, len(ids) - shared - tail) + [0] * min(tail, len(ids) - shared)
    ans, rest = enc(text[cut:end]), enc(text[end:])
    return head + ans + rest, [0] * len(head) + [1] * len(ans) + [0] * len(rest)


@dataclass(frozen=True)
class Mix:
    """Share of windows of each kind (the rest is plain natural text): 80 % carry a task. A kv window
    holds 1 to min(max_pairs, n // pair_tokens) facts and queries up to max_queries of them (all of them
    when query_all); a share `few` of kv windows holds only 1 to 3 facts (needles in a long haystack); a
    share `lead` of kv windows opens with its first fact (a context's first line: a system prompt, a file
    header), a place the uniform layout almost never draws; a share `far` of kv windows keeps all its facts
    in the window's first quarter, so each is queried from three quarters of the window away or more (the
    longest distances, which a uniform layout draws least often in multi-fact windows)."""

    kv: float = 0.5
    copy: float = 0.2
    vartrack: float = 0.1
    pair_tokens: int = 40
    max_queries: int = 12
    query_all: bool = False
    max_pairs: int = 64
    few: float = 0.0
    lead: float = 0.0
    far: float = 0.0


# Retrieval-dense windows: every fact queried (up to 32): ~2x the key -> value answer tokens per token of
# the default mix (what associative recall is learned from); 95 % of windows carry a task.
DENSE = Mix(kv=0.65, copy=0.2, vartrack=0.1, pair_tokens=40, max_queries=32, query_all=True)
# For long windows (8K-16K): more windows with facts, up to 128 facts and 64 queries per window (a 16K
# window of the dense mix answers only ~32), and a quarter of kv windows needle-like (1-3 facts).
LONG = Mix(kv=0.75, copy=0.1, vartrack=0.1, pair_tokens=40, max_queries=64, query_all=True, max_pairs=128,
           few=0.25)  # fmt: skip
# Needle-heavy long windows: half of the kv windows needle-like, and 30 % of kv windows open with a fact.
NEEDLE = Mix(kv=0.8, copy=0.1, vartrack=0.05, pair_tokens=40, max_queries=64, query_all=True, max_pairs=128,
             few=0.5, lead=0.3)  # fmt: skip
# Long-distance windows: as NEEDLE without the opening facts, and half of the kv windows with every fact in
# the first quarter (queried from the end: a 16K needle at depth 0 is the case this trains).
FAR = Mix(kv=0.8, copy=0.1, vartrack=0.05, pair_tokens=40, max_queries=64, query_all=True, max_pairs=128,
          few=0.5, far=0.5)  # fmt: skip
MIXES = {"default": Mix(), "dense": DENSE, "long": LONG, "needle": NEEDLE, "far": FAR}


Ids = tuple[list[int], list[int]]  # token ids and a same-length 0/1 answer mask


def _splice(hay: list[int], inserts: list[tuple[int, list[int]]]) -> list[int]:
    """Insert token lists at haystack positions (positions in the original haystack)."""
    out, last = [], 0
    for pos, toks in sorted(inserts, key=lambda x: x[0]):
        out.extend(hay[last:pos])
        out.extend(toks)
        last = pos
    out.extend(hay[last:])
    return out


def _plain(hay: list[int], n: int) -> Ids:
    return hay[: n + 1], [0] * (n + 1)


def kv_window(hay: list[int], n: int, tok: Tokenizer, rng: np.random.Generator, mix: Mix = Mix()) -> Ids:
    """n + 1 tokens: facts spread through the haystack, queries at the end (needle when one fact)."""
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    top = max(2, min(mix.max_pairs, n // mix.pair_tokens))
    if mix.few and rng.random() < mix.few:  # (no draw for mixes without `few`: their windows unchanged)
        top = min(top, 3)
    pairs = int(rng.integers(1, top + 1))
    fact_t, query_ts = FORMS[rng.integers(len(FORMS))]
    d = word(rng, int(rng.integers(1, 4)))
    keys = list(dict.fromkeys(random_key(rng) for _ in range(pairs)))
    vals = [random_value(rng) for _ in keys]
    facts = [enc("\n" + fact_t.format(k=k, v=v, d=d) + "\n") for k, v in zip(keys, vals, strict=True)]
    most = min(len(keys), mix.max_queries)
    nq = most if mix.query_all else int(rng.integers(1, most + 1))
    queries = enc("\n")
    qmask = [0] * len(queries)
    for i in rng.permutation(len(keys))[:nq]:
        qt = query_ts[rng.integers(len(query_ts))]
        ids, mask = split_query(qt, rng, enc, k=keys[i], v=vals[i], d=d)
        queries, qmask = queries + ids, qmask + mask
    budget = n + 1 - len(queries) - sum(len(f) for f in facts)
    if budget < 16:  # too many facts for this length: fall back to plain text
        return _plain(hay, n)
    body = hay[:budget]
    far = bool(mix.far) and rng.random() < mix.far  # (no draw for mixes without `far`)
    pos = np.sort(rng.integers(0, (budget // 4 if far else budget) + 1, size=len(facts)))
    if mix.lead and rng.random() < mix.lead:  # (no draw for mixes without `lead`)
        pos[0] = 0
    ids = _splice(body, list(zip(pos.tolist(), facts, strict=True)))
    return (ids + queries)[: n + 1], ([0] * len(ids) + qmask)[: n + 1]


def copy_window(hay: list[int], n: int, tok: Tokenizer, rng: np.random.Generator) -> Ids:
    """A segment appears again later, verbatim (what induction heads learn): half the time a span of the
    haystack repeated, half the time a quoted string of random words assigned early and asserted last.
    The repeat is the answer."""
    if rng.random() < 0.5:
        seg = int(rng.integers(32, max(33, n // 3)))
        start = int(rng.integers(0, max(1, n - 2 * seg)))
        at = int(rng.integers(start + seg, max(start + seg + 1, n + 1 - seg)))
        ids = hay[:at] + hay[start : start + seg] + hay[at:]
        mask = [0] * at + [0] + [1] * (seg - 1) + [0] * len(hay[at:])  # the repeat's first id is a guess
        return ids[: n + 1], mask[: n + 1]
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    name, target = random_key(rng), int(rng.integers(24, max(25, n // 3)))
    words: list[str] = []
    while len(enc(" ".join(words))) < target:
        words += [word(rng, int(rng.integers(1, 4))) for _ in range(8)]
    text = " ".join(words)
    fact = enc(f'\n{name} = "{text}"\n')
    query, qmask = split_query('assert {k} == "{v}"', rng, enc, k=name, v=text)
    budget = n + 1 - len(fact) - len(query) - 1
    if budget < 16:
        return _plain(hay, n)
    at = int(rng.integers(0, budget // 2 + 1))
    ids = hay[:at] + fact + hay[at:budget] + enc("\n")
    return ids + query, [0] * len(ids) + qmask  # n + 1 tokens by construction


def vartrack_window(hay: list[int], n: int, tok: Tokenizer, rng: np.random.Generator) -> Ids:
    """Chains `a = 123` ... `b = a` ... `c = b` spread through the text; `assert c == 123` at the end."""
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    inserts, used = [], 0
    queries = enc("\n")
    qmask = [0] * len(queries)
    for _ in range(int(rng.integers(1, 4))):
        names = [random_key(rng) for _ in range(int(rng.integers(2, 6)))]
        value = str(int(rng.integers(100, 10**6)))
        lines = [f"{names[0]} = {value}"] + [f"{b} = {a}" for a, b in itertools.pairwise(names)]
        toks = [enc("\n" + line + "\n") for line in lines]
        inserts.append(toks)
        used += sum(len(t) for t in toks)
        ids, mask = split_query("assert {k} == {v}", rng, enc, k=names[-1], v=value)
        queries, qmask = queries + ids, qmask + mask
    budget = n + 1 - len(queries) - used
    if budget < 16:
        return _plain(hay, n)
    body, placed = hay[:budget], []
    for toks in inserts:  # each chain in order, at increasing positions
        pos = np.sort(rng.integers(0, budget + 1, size=len(toks)))
        placed += list(zip(pos.tolist(), toks, strict=True))
    ids = _splice(body, placed)
    return (ids + queries)[: n + 1], ([0] * len(ids) + qmask)[: n + 1]


def make_window(
    streams: list[np.ndarray], n: int, tok: Tokenizer, rng: np.random.Generator, mix: Mix
) -> tuple[np.ndarray, np.ndarray]:
    """(n + 1 token ids, n + 1 answer flags): natural text from one source (chosen uniformly), maybe with
    a task in it; a flag marks a token only the context can give (a value queried, a repeat)."""
    stream = streams[int(rng.integers(len(streams)))]
    s = int(rng.integers(0, stream.size - n - 1))
    hay = stream[s : s + n + 1].tolist()
    u = rng.random()
    if u < mix.kv:
        out, mask = kv_window(hay, n, tok, rng, mix)
    elif u < mix.kv + mix.copy:
        out, mask = copy_window(hay, n, tok, rng)
    elif u < mix.kv + mix.copy + mix.vartrack:
        out, mask = vartrack_window(hay, n, tok, rng)
    else:
        out, mask = _plain(hay, n)
    assert len(out) == n + 1 and len(mask) == n + 1, (len(out), len(mask), n)
    return np.asarray(out, dtype=np.int64), np.asarray(mask, dtype=np.int8)

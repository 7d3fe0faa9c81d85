"""Both sides of a comparison must read token ids the same way: tokenizer fingerprints, compared before
anything is measured.

An A/B of two servers, a server against a recording, or a server fed ids from ``--tokenizer`` compares
log-probabilities position by position over the same token ids. If the two tokenizers differ the ids
mean different text on each side, and the figures (a large KL, a low top-1 agreement) look like a
real, bad result. So each tokenizer in play is fingerprinted: its vocabulary size (``/tokenizer_info``
where the server offers it; the local tokenizer's) and the ids of a fixed probe text (``/tokenize``, the
local tokenizer, or the recording's header). Any difference stops the run with one line naming both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlaq.validate.server.client import ServerError

# code, prose, digits, whitespace runs and non-ASCII: tokenizers of different models split it differently
PROBE = 'def f(x):\n    return "Grüße, 世界 ✓" + str(x * 42)  # The quick brown fox jumps.\n'


@dataclass(frozen=True)
class Fingerprint:
    source: str  # who tokenized: "http://host:port", "--tokenizer PATH", "recording FILE"
    vocab_size: int | None = None
    probe_ids: tuple[int, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        ids = None if self.probe_ids is None else list(self.probe_ids)
        return {"vocab_size": self.vocab_size, "probe_ids": ids}

    @classmethod
    def from_json(cls, source: str, d: Any) -> Fingerprint | None:
        if not isinstance(d, dict):
            return None  # a recording made before fingerprints: nothing to compare
        ids = d.get("probe_ids")
        return cls(source, d.get("vocab_size"), None if ids is None else tuple(int(i) for i in ids))


def of_server(client: Any, model: str) -> Fingerprint:
    """A server's tokenizer, from what it offers (``/tokenizer_info``, ``/tokenize``); None where not."""
    vocab = None
    try:
        info = client.get_json("/tokenizer_info")
        vocab = info.get("vocab_size") if isinstance(info, dict) else None
    except ServerError:
        pass
    ids = None
    try:
        r = client.post_json("/tokenize", {"model": model, "prompt": PROBE, "add_special_tokens": False})
        ids = tuple(int(t) for t in r["tokens"])
    except (ServerError, KeyError, TypeError, ValueError):
        pass
    return Fingerprint(client.config.base, vocab if isinstance(vocab, int) else None, ids)


def of_local(path: Path) -> Fingerprint:
    from mlaq.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(path.parent if path.name == "tokenizer.json" else path)
    return Fingerprint(
        f"--tokenizer {path}", tok.vocab_size, tuple(tok.encode(PROBE, add_special_tokens=False))
    )


def check_same(prints: list[Fingerprint]) -> None:
    """ValueError (one line) when two fingerprints disagree on what both of them know."""
    for i, a in enumerate(prints):
        for b in prints[i + 1 :]:
            why = _difference(a, b)
            if why:
                raise ValueError(
                    f"the tokenizers differ: {a.source} and {b.source} ({why}); the same token ids would mean "
                    "different text on each side, so the comparison would be meaningless. Compare servers of "
                    "the same model (and --tokenizer of that model)"
                )


def _difference(a: Fingerprint, b: Fingerprint) -> str | None:
    if a.vocab_size is not None and b.vocab_size is not None and a.vocab_size != b.vocab_size:
        return f"vocabularies of {a.vocab_size:,} and {b.vocab_size:,} tokens"
    if a.probe_ids is not None and b.probe_ids is not None and a.probe_ids != b.probe_ids:
        return f"a probe text becomes {len(a.probe_ids)} and {len(b.probe_ids)} different ids"
    return None


def check_all(cfg: Any, cand: Any, ref: Any, rec: Any) -> dict[str, Any]:
    """Fingerprint every tokenizer in play (``cfg``: the ServerValidateConfig; ``cand`` / ``ref``: the
    ServerTargets, probed; ``rec``: the --against Recording or None) and stop (one line) when two differ;
    tells the targets where their token ids come from (for the out-of-vocabulary hint); returns the
    fingerprint a recording keeps."""
    local = of_local(cfg.tokenizer) if cfg.tokenizer is not None else None
    prints = [of_server(t.client, t.model) for t in (cand, ref) if t is not None]
    prints += [local] if local is not None else []
    recorded = Fingerprint.from_json(
        f"the recording {cfg.against}", (rec.header if rec else {}).get("tokenizer")
    )
    if recorded is not None:
        prints.append(recorded)
    check_same(prints)
    if rec is not None:
        ids_from = f"the recording {cfg.against}"
    else:
        ids_from = f"--tokenizer {cfg.tokenizer}" if cfg.tokenizer else f"{cand.client.config.base}/tokenize"
    for t in (cand, ref):
        if t is not None:
            t.ids_from = ids_from
    own = prints[0]
    return {
        "vocab_size": own.vocab_size if own.vocab_size is not None else local and local.vocab_size,
        "probe_ids": list(own.probe_ids or (local.probe_ids if local else None) or []) or None,
    }

"""A recorded reference run (``--record FILE`` / ``--against FILE``), llama.cpp's ``--kl-divergence-base``
idea: the reference's teacher-forced top-k log-probabilities, its greedy tokens and its acceptance are
saved once, and later runs are compared against the file (the reference server need not stay up).

Two containers, chosen by the file's suffix: ``.json`` (readable, larger) or ``.safetensors`` (tensors +
a JSON header in the metadata); any other suffix is refused. Never pickle. ``--record`` replaces only a
recording (recognised by its header), anything else only with ``--overwrite``. The input token ids are saved too, so a later
run sends exactly the same windows and prompts without tokenizing anything.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError

from mlaq.validate.server.protocol import TeacherForced

RECORD_VERSION = 1
_MAGIC = "mlaq-validate-record"


@dataclass(frozen=True)
class Recording:
    header: dict[str, Any]  # identity, config, eval text, acceptance: JSON-ready
    windows: tuple[TeacherForced, ...]
    prompts: tuple[tuple[int, ...], ...]
    generations: tuple[tuple[int, ...], ...]
    # per generation, the top-k maps of its tokens (the decode-path comparison), or None
    generation_tops: tuple[tuple[dict[int, float], ...] | None, ...] = ()


def _top_arrays(top: tuple[dict[int, float], ...]) -> tuple[np.ndarray, np.ndarray]:
    """(N, K) ids (-1 padded) and log-probs (-inf padded), each row sorted by log-prob."""
    width = max((len(d) for d in top), default=0)
    ids = np.full((len(top), width), -1, dtype=np.int64)
    lps = np.full((len(top), width), -np.inf, dtype=np.float64)
    for i, d in enumerate(top):
        items = sorted(d.items(), key=lambda kv: -kv[1])
        ids[i, : len(items)] = [k for k, _ in items]
        lps[i, : len(items)] = [v for _, v in items]
    return ids, lps


def _maps(ids: np.ndarray, lps: np.ndarray) -> tuple[dict[int, float], ...]:
    return tuple(
        {int(i): float(v) for i, v in zip(row_i, row_v, strict=True) if i >= 0}
        for row_i, row_v in zip(ids, lps, strict=True)
    )


def _from_arrays(tokens: Sequence[int], lp: np.ndarray, ids: np.ndarray, lps: np.ndarray) -> TeacherForced:
    return TeacherForced(tuple(int(t) for t in tokens), lp.astype(np.float64), _maps(ids, lps))


SUFFIXES = (".safetensors", ".json")


def check_record_path(path: Path, overwrite: bool = False) -> None:
    """Before measuring: ``--record``'s suffix picks the format, and an existing file is replaced only
    when it is a recording (or with ``overwrite``); one line otherwise."""
    if path.suffix not in SUFFIXES:
        raise ValueError(
            f"--record {path}: the suffix picks the format; name it .safetensors (compact) or .json (readable)"
        )
    if path.is_dir():
        raise ValueError(f"--record {path} is a directory; give a file name")
    if not path.parent.is_dir():
        raise ValueError(f"--record {path}: no directory {path.parent}")
    if (path.exists() or path.is_symlink()) and not overwrite and not is_recording(path):
        raise ValueError(
            f"--record {path} exists and is not an mlaq recording; move it away, pick another name, "
            "or pass --overwrite"
        )


def is_recording(path: Path) -> bool:
    """True when ``path`` holds an mlaq validate recording (its header says so)."""
    try:
        return load_recording(path).header.get("magic") == _MAGIC
    except (ValueError, FileNotFoundError):
        return False


def save_recording(path: Path, rec: Recording) -> None:
    """Write ``rec`` atomically (a failed write leaves any previous file untouched)."""
    header = {"magic": _MAGIC, "version": RECORD_VERSION, **rec.header}
    arrays: dict[str, np.ndarray] = {}
    for w, tf in enumerate(rec.windows):
        ids, lps = _top_arrays(tf.top)
        arrays[f"window.{w}.tokens"] = np.array(tf.tokens, dtype=np.int64)
        arrays[f"window.{w}.token_logprobs"] = tf.token_logprobs
        arrays[f"window.{w}.top_ids"] = ids
        arrays[f"window.{w}.top_logprobs"] = lps
    for p, (prompt, gen) in enumerate(zip(rec.prompts, rec.generations, strict=True)):
        arrays[f"prompt.{p}"] = np.array(prompt, dtype=np.int64)
        arrays[f"generation.{p}"] = np.array(gen, dtype=np.int64)
        top = rec.generation_tops[p] if p < len(rec.generation_tops) else None
        if top is not None:
            arrays[f"generation.{p}.top_ids"], arrays[f"generation.{p}.top_logprobs"] = _top_arrays(top)
    header["windows"], header["prompts"] = len(rec.windows), len(rec.prompts)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        if path.suffix == ".json":
            as_lists = {k: _json_array(v) for k, v in arrays.items()}
            tmp.write_text(json.dumps({"header": header, "arrays": as_lists}), encoding="utf-8")
        else:
            from safetensors.numpy import save_file

            # safetensors needs at least one tensor and contiguous arrays
            save_file(
                {k: np.ascontiguousarray(v) for k, v in arrays.items()},
                str(tmp),
                {"mlaq": json.dumps(header)},
            )
        os.replace(tmp, path)
    except OSError as exc:
        raise ValueError(f"--record {path}: cannot write ({exc.strerror or exc})") from None
    finally:
        tmp.unlink(missing_ok=True)


def _json_array(a: np.ndarray) -> Any:
    # -inf (padding) is not JSON: write null
    return [_json_array(x) for x in a] if a.ndim > 1 else [None if np.isneginf(x) else x.item() for x in a]


def load_recording(path: Path) -> Recording:
    """Read a file written by ``save_recording``; a clear error for anything else."""
    if not path.is_file():
        raise FileNotFoundError(f"--against {path}: no such file (write one with --record)")
    try:
        if path.suffix == ".json":
            doc = json.loads(path.read_text(encoding="utf-8"))
            header = doc["header"]
            arrays = {k: _from_json(v, k) for k, v in doc["arrays"].items()}
        else:
            from safetensors import safe_open

            with safe_open(str(path), framework="numpy") as f:
                header = json.loads((f.metadata() or {})["mlaq"])
                arrays = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    except (KeyError, ValueError, OSError, SafetensorError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"--against {path}: not an mlaq validate recording ({_one_line(exc)})") from None
    if (
        not isinstance(header, dict)
        or header.get("magic") != _MAGIC
        or header.get("version") != RECORD_VERSION
    ):
        raise ValueError(
            f"--against {path}: not an mlaq validate recording of version {RECORD_VERSION}; record it again"
        )
    try:
        return _recording(header, arrays)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"--against {path}: the recording is incomplete or damaged ({exc}); record it again"
        ) from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]


def _recording(header: dict[str, Any], arrays: dict[str, np.ndarray]) -> Recording:
    windows = tuple(
        _from_arrays(
            arrays[f"window.{w}.tokens"],
            arrays[f"window.{w}.token_logprobs"],
            arrays[f"window.{w}.top_ids"],
            arrays[f"window.{w}.top_logprobs"],
        )
        for w in range(header["windows"])
    )
    prompts = tuple(tuple(int(t) for t in arrays[f"prompt.{p}"]) for p in range(header["prompts"]))
    gens = tuple(tuple(int(t) for t in arrays[f"generation.{p}"]) for p in range(header["prompts"]))
    tops = tuple(
        _maps(arrays[f"generation.{p}.top_ids"], arrays[f"generation.{p}.top_logprobs"])
        if f"generation.{p}.top_ids" in arrays
        else None
        for p in range(header["prompts"])
    )
    return Recording(header, windows, prompts, gens, tops)


def _from_json(v: Any, key: str) -> np.ndarray:
    if key.endswith(("tokens", "top_ids")) or re.fullmatch(r"(prompt|generation)\.\d+", key):
        return np.array(v, dtype=np.int64)
    if key.endswith("top_logprobs"):
        v = [[-np.inf if x is None else x for x in row] for row in v]
    return np.array(v, dtype=np.float64)

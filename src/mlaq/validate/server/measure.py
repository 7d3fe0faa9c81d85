"""Measuring live servers: probe them, pick the inputs, teacher-force every window and greedy-generate
every prompt on each side, and read MTP acceptance (``measure_sides``). A measurement a server cannot
support is kept as an error on its side while the others still run. ``sources.server`` turns the sides
into the measurement record.

Inputs are chosen exactly as local validate chooses them (same tokens and seed -> same windows and
prompts); with ``--against`` they are the recording's own token ids.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from mlaq.validate.progress import NullProgress, Progress
from mlaq.validate.server import mc as server_mc
from mlaq.validate.server import tasks as server_tasks
from mlaq.validate.server import tokenizers
from mlaq.validate.server.client import Unsupported
from mlaq.validate.server.config import ServerValidateConfig
from mlaq.validate.server.protocol import Greedy
from mlaq.validate.server.record import Recording, load_recording, save_recording
from mlaq.validate.server.sides import Inputs, Side, Tokenizing
from mlaq.validate.server.spec import counter_delta, per_request_stats, total
from mlaq.validate.server.target import ServerTarget

T = TypeVar("T")
R = TypeVar("R")


def _pmap(fn: Callable[[T], R], items: Sequence[T], n: int, progress: Progress, label: str) -> list[R]:
    """``fn`` over ``items`` with ``n`` requests in flight; progress advances as results arrive."""
    out: list[R] = []
    with ThreadPoolExecutor(max_workers=n) as ex:
        futures = [ex.submit(fn, x) for x in items]
        try:
            for i, f in enumerate(futures):
                out.append(f.result())
                progress.step(f"{label} {i + 1}/{len(items)}")
        except BaseException:
            ex.shutdown(cancel_futures=True)
            raise
    return out


@dataclass
class Sides:
    candidate: Side
    reference: Side | None  # a live server, a recording, or None (the candidate alone)
    inputs: Inputs
    seconds: float
    suite: Any = None  # TaskSuiteRecord when the task suite ran


def measure_sides(cfg: ServerValidateConfig, progress: Progress | None = None) -> Sides:
    """Every server measurement of a run (and the --record file, when asked for)."""
    progress = progress or NullProgress()
    t0 = time.perf_counter()
    recorded = load_recording(cfg.against) if cfg.against else None
    note = getattr(progress, "note", None)  # "still waiting" lines, above the bar
    cand = ServerTarget(cfg.server, model=cfg.model, tokenizer=cfg.tokenizer, note=note)
    ref = None
    if cfg.reference is not None:
        ref = ServerTarget(cfg.reference, model=cfg.reference_model, tokenizer=cfg.tokenizer, note=note)
    try:
        ident = cand.probe()
        ref_ident = ref.probe() if ref else None
        tokenizer = tokenizers.check_all(cfg, cand, ref, recorded)  # before measuring: same ids, same text
        inputs = _inputs(cfg, cand, ref_ident.max_model_len if ref_ident else None, recorded)
        targets = [(cand, Side(ident.to_json()))]
        if ref is not None and ref_ident is not None:
            targets.append((ref, Side(ref_ident.to_json())))
        suite = None
        if cfg.shape.tasks is not None:
            limits = [m for m in (ident.max_model_len, ref_ident.max_model_len if ref_ident else None) if m]
            suite = server_tasks.draw_samples(cfg, inputs, cand, min(limits) if limits else None)
        n_tasks = 2 * len(suite.samples) if suite is not None else 0
        n_mc = server_mc.steps(cfg, len(targets)) if ref is not None else 0
        progress.begin((len(inputs.windows) + len(inputs.prompts) + n_tasks) * len(targets) + n_mc)
        ok = False
        try:
            for target, side in targets:
                _teacher_forced(cfg, target, side, inputs, progress)
            for target, side in targets:
                _generate(cfg, target, side, inputs, progress)
            if ref is not None:
                server_mc.sample_and_score(cfg, ref, targets, inputs, progress, _pmap)
            if suite is not None:
                for target, side in targets:
                    server_tasks.score(cfg, suite, target, side, progress)
            ok = True
        finally:
            progress.end(ok)
        for target, side in targets:  # the teacher-forcing mode is known only now
            if target.identity is not None:
                side.identity = target.identity.to_json()
    finally:
        cand.close()
        if ref is not None:
            ref.close()
    candidate = targets[0][1]
    reference = targets[1][1] if len(targets) > 1 else _recorded_side(recorded) if recorded else None
    if cfg.record is not None:
        _record(cfg, candidate, inputs, tokenizer)
    record = None if suite is None else suite.record()
    return Sides(candidate, reference, inputs, time.perf_counter() - t0, record)


def _inputs(
    cfg: ServerValidateConfig, cand: ServerTarget, ref_max_len: int | None, rec: Recording | None
) -> Inputs:
    limits = [m for m in (cand.identity.max_model_len if cand.identity else None, ref_max_len) if m]
    max_len = min(limits) if limits else None
    if rec is not None:
        c = rec.header["config"]
        windows = [list(w.tokens) for w in rec.windows]
        need = max([len(w) + 1 for w in windows] + [len(p) + c["max_tokens"] for p in rec.prompts])
        if max_len is not None and need > max_len:
            raise ValueError(
                f"--against's windows need {need} tokens; the server's max_model_len is {max_len}"
            )
        prompts = [list(p) for p in rec.prompts]
        return Inputs(windows, prompts, c["context_len"], c["max_tokens"], rec.header["eval_text"])
    from mlaq.bundled import bundled_model_dir
    from mlaq.validate.config import default_eval_text
    from mlaq.validate.text import load_eval_text

    context, shape = cfg.resolve_context(max_len), cfg.shape
    if max_len is not None and shape.prompt_len + shape.max_tokens > max_len:
        raise ValueError(
            f"--prompt-len {shape.prompt_len} + --max-tokens {shape.max_tokens} exceed the server's "
            f"max_model_len {max_len}; shorten them"
        )
    path = shape.eval_text or default_eval_text(bundled_model_dir())
    data = load_eval_text(
        path,
        Tokenizing(cand, cfg.tokenizer),
        context_len=context,
        windows=shape.windows,
        prompts=shape.prompts,
        prompt_len=shape.prompt_len,
        seed=shape.seed,
    )
    return Inputs(
        [list(w[0].tolist()) for w in data.windows()],
        data.prompts(),
        context,
        shape.max_tokens,
        text_tokens=data.tokens,
        eval_text={
            "path": str(path),
            "sha256": data.sha256,
            "bytes": data.num_bytes,
            "tokens": len(data.tokens),
            "window_starts": list(data.window_starts),
            "prompt_starts": list(data.prompt_starts),
        },
    )


def _teacher_forced(
    cfg: ServerValidateConfig, target: ServerTarget, side: Side, inputs: Inputs, progress: Progress
) -> None:
    start = time.perf_counter()
    try:
        target.probe_teacher_forcing(cfg.logprobs)
        side.windows = _pmap(
            lambda w: target.teacher_forced(w, cfg.logprobs),
            inputs.windows,
            cfg.concurrency,
            progress,
            f"{target.model}: teacher-forced window",
        )
    except Unsupported as exc:
        side.errors["teacher_forced"] = str(exc)
        for _ in inputs.windows:
            progress.step(f"{target.model}: teacher forcing unsupported")
    side.seconds["teacher_forced"] = time.perf_counter() - start


def _generate(
    cfg: ServerValidateConfig, target: ServerTarget, side: Side, inputs: Inputs, progress: Progress
) -> None:
    start = time.perf_counter()
    ident = target.identity
    before = target.scrape() if ident is not None and ident.metrics else None
    side.generations = _pmap(
        lambda p: target.greedy(p, inputs.max_tokens, cfg.logprobs),
        inputs.prompts,
        cfg.concurrency,
        progress,
        f"{target.model}: greedy generation",
    )
    after = target.scrape() if before is not None else None
    side.seconds["generation"] = time.perf_counter() - start
    if side.generations:
        side.sample = target.detokenize(side.generations[0].tokens)
    if not inputs.prompt_sample and inputs.prompts:
        inputs.prompt_sample = target.detokenize(inputs.prompts[0][-48:])
    if any(g.ids_from_text for g in side.generations):
        side.warnings.append(
            "the server returned no token ids for completions: ids were recovered by tokenizing the text "
            "(first-divergence figures are approximate)"
        )
    per_request = total(per_request_stats(g.spec) for g in side.generations)
    if per_request is not None:
        side.acceptance, side.acceptance_source = per_request, "per_request"
        return
    if before is None or after is None:
        side.errors["acceptance"] = "no /metrics endpoint and no per-request metrics: MTP acceptance unknown"
        return
    delta = counter_delta(before, after, len(inputs.prompts))
    if delta.warning:
        side.warnings.append(delta.warning)
    if delta.stats is None or delta.stats.num_drafts == 0:
        side.errors["acceptance"] = (
            "the server reports no speculative decoding (no vllm:spec_decode_* counters moved): "
            "no MTP acceptance figures"
        )
        return
    side.acceptance, side.acceptance_source = delta.stats, "metrics"


def _recorded_side(rec: Recording) -> Side:
    from mlaq.engine.spec_metrics import SpecDecodingStats

    acc = rec.header.get("acceptance")
    stats = None
    if acc:
        stats = SpecDecodingStats(
            acc["num_drafts"], acc["num_draft_tokens"], acc["num_accepted_tokens"], tuple(acc["per_pos"])
        )
    side = Side({**rec.header["identity"], "recording": True})
    side.windows = list(rec.windows) or None
    tops = rec.generation_tops or (None,) * len(rec.generations)
    side.generations = [Greedy(g, None, top=t) for g, t in zip(rec.generations, tops, strict=True)]
    side.acceptance, side.acceptance_source = stats, "recording" if stats else None
    return side


def _record(cfg: ServerValidateConfig, side: Side, inputs: Inputs, tokenizer: dict[str, Any]) -> None:
    if side.windows is None or side.generations is None:
        raise ValueError(f"--record {cfg.record}: nothing to record ({side.errors})")
    s = side.acceptance
    acc = None
    if s is not None:
        acc = {
            "num_drafts": s.num_drafts,
            "num_draft_tokens": s.num_draft_tokens,
            "num_accepted_tokens": s.num_accepted_tokens,
            "per_pos": list(s.num_accepted_tokens_per_pos),
        }
    header = {
        "identity": side.identity,
        "config": {
            "context_len": inputs.context_len,
            "max_tokens": inputs.max_tokens,
            "logprobs": cfg.logprobs,
        },
        "eval_text": inputs.eval_text,
        "acceptance": acc,
        "tokenizer": tokenizer,
    }
    assert cfg.record is not None
    save_recording(
        cfg.record,
        Recording(
            header,
            tuple(side.windows),
            tuple(map(tuple, inputs.prompts)),
            tuple(g.tokens for g in side.generations),
            tuple(g.top for g in side.generations),
        ),
    )

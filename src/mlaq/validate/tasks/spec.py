"""What the long-context task suite runs: task names, lengths, samples, needle depths (no heavy imports).

The suite is RULER-style (Hsieh et al. 2024, "RULER: What's the real context size of your long-context
language models?"): synthetic retrieval tasks hidden in a natural haystack, at chosen total lengths,
with fresh random keys and values per sample so no answer can be known without reading the context.
"""

from __future__ import annotations

from dataclasses import dataclass

TASK_NAMES = ("needle", "multikey", "copy", "vartrack")
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
MAX_DEFAULT_LENGTH = 4096  # --lengths default: the model's context, capped (CPU emulation)
# --task-samples default: samples go where they are informative, at the full context and to the
# retrieval tasks a small model solves (30 paired samples detect a 20-point drop from 100 %: the exact
# test needs 6 of them to flip); copy and vartrack get two each, enough to show whether the model can
# do them at all (a task bf16 fails is reported as not measurable on the model).
DEFAULT_SAMPLES = (("needle", 30), ("multikey", 30), ("copy", 2), ("vartrack", 2))
MIN_PAIRS = 16  # multikey: at least 16 key-value pairs (the minimum; MQAR uses 16-256)
MIN_COPY_TOKENS = 64


def parse_tasks(text: str) -> tuple[str, ...]:
    """'needle,copy' -> ('needle', 'copy'); an unknown or repeated name is a clear error."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise ValueError(f"--tasks: no task given; choose from {','.join(TASK_NAMES)}")
    for name in names:
        if name not in TASK_NAMES:
            raise ValueError(f"--tasks: unknown task {name!r}; known tasks: {', '.join(TASK_NAMES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--tasks: a task is listed twice: {text}")
    return names


def parse_ints(flag: str, text: str) -> tuple[int, ...]:
    """'512,1024' -> (512, 1024), each >= 1, sorted and distinct."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(
            f"{flag}: expected comma-separated integers such as 512,1024, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag}: expected positive integers, got {text!r}")
    return tuple(sorted(set(values)))


def parse_samples(text: str) -> tuple[int, tuple[tuple[str, int], ...]]:
    """'20' -> (20, ()) (every task); 'needle=32,copy=4' -> those tasks, the rest at the default
    allocation's count (or 4). Returns (samples, per_task)."""
    text = text.strip()
    if "=" not in text:
        try:
            return int(text), ()
        except ValueError:
            raise ValueError(
                f"--task-samples: expected a number such as 20 or per task such as needle=32,copy=4, got {text!r}"
            ) from None
    per: dict[str, int] = dict(DEFAULT_SAMPLES)
    for item in (x.strip() for x in text.split(",") if x.strip()):
        name, _, n = item.partition("=")
        name = name.strip()
        if name not in TASK_NAMES:
            raise ValueError(f"--task-samples: unknown task {name!r}; known tasks: {', '.join(TASK_NAMES)}")
        try:
            per[name] = int(n)
        except ValueError:
            raise ValueError(f"--task-samples: {item!r} needs a whole number after '='") from None
    return 4, tuple(per.items())


def parse_depths(text: str) -> tuple[float, ...]:
    """'0,0.5,1' -> (0.0, 0.5, 1.0); every depth in [0, 1]."""
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(
            f"--needle-depths: expected numbers in [0, 1] such as 0,0.5,1, got {text!r}"
        ) from None
    if not values:
        raise ValueError("--needle-depths: give at least one depth in [0, 1]")
    for v in values:
        if not 0.0 <= v <= 1.0:
            raise ValueError(
                f"--needle-depths: depth {v:g} is outside [0, 1] (0: start of the context, 1: end)"
            )
    return tuple(sorted(set(values)))


def default_lengths(max_context: int, cap: int = MAX_DEFAULT_LENGTH) -> tuple[int, ...]:
    """The full context, capped: where a scheme's damage shows first (the most competing keys)."""
    return (min(cap, max_context),)


@dataclass(frozen=True)
class TaskConfig:
    """One run of the suite. ``samples`` per task and length, or per task from ``per_task`` (task, n)
    where it names the task; needle samples cycle through ``depths``."""

    tasks: tuple[str, ...] = TASK_NAMES
    lengths: tuple[int, ...] | None = None  # None: default_lengths(the model's context)
    samples: int = 10
    per_task: tuple[tuple[str, int], ...] = ()
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    seed: int = 0
    pairs: int = MIN_PAIRS  # multikey
    copy_tokens: int = MIN_COPY_TOKENS  # copy: the segment is at least this many tokens
    hops: int = 4  # vartrack: assignments per chain (x1 = value; x2 = x1; ...)
    chains: int = 2  # vartrack: chains in the context, one queried (the others are distractors)
    batch_tokens: int = 4096  # tokens per forward pass (sequences batched up to this many)

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError(f"no task given; choose from {','.join(TASK_NAMES)}")
        for name in self.tasks:
            if name not in TASK_NAMES:
                raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASK_NAMES)}")
        if self.samples < 1 or any(n < 1 for _, n in self.per_task):
            raise ValueError(f"--task-samples must be at least 1, got {self.samples} {self.per_task or ''}")
        if self.lengths is not None and (not self.lengths or min(self.lengths) < 1):
            raise ValueError(f"--lengths must be positive token counts, got {self.lengths}")
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError(f"--needle-depths must lie in [0, 1], got {self.depths}")
        if self.pairs < MIN_PAIRS:
            raise ValueError(f"multikey needs at least {MIN_PAIRS} key-value pairs, got {self.pairs}")
        if self.copy_tokens < MIN_COPY_TOKENS:
            raise ValueError(
                f"copy needs a segment of at least {MIN_COPY_TOKENS} tokens, got {self.copy_tokens}"
            )
        if self.hops < 2 or self.chains < 1 or self.batch_tokens < 1:
            raise ValueError("vartrack needs hops >= 2 and chains >= 1; batch_tokens must be >= 1")

    def samples_of(self, task: str) -> int:
        """Samples per length of ``task``."""
        return dict(self.per_task).get(task, self.samples)

    def check_context(self, max_context: int, model: str = "the model") -> None:
        """A length beyond the model's context is an error naming the maximum."""
        too_long = [n for n in self.lengths or () if n > max_context]
        if too_long:
            raise ValueError(
                f"--lengths {','.join(map(str, too_long))} exceed {model}'s context of {max_context} tokens "
                f"(max_position_embeddings); use lengths up to {max_context}"
            )

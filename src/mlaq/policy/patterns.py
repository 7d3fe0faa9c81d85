"""Module-name patterns as quantization configs write them: exact names, ``re:`` regexes, shell globs.

Semantics (one set, used for checkpoint configs and ``--quantization-config`` alike):

- ``re:REGEX`` — Python regex applied with ``re.match``: anchored at the START of the name, not at
  its end. That is what vLLM's compressed-tensors and Quark integrations and compressed-tensors
  itself do, so ``re:.*self_attn.*`` and ``re:model.layers.61.*`` mean here what they mean there.
  Add ``$`` to anchor the end.
- a pattern containing ``*``, ``?`` or ``[`` — a shell glob matched against the WHOLE name,
  case-sensitively (``fnmatch.fnmatchcase``), as vLLM matches Quark ``layer_quant_config`` keys and
  ModelOpt ``exclude_modules`` (``model.layers.21.self_attn*``).
- anything else — an exact module name.

A pattern *covers* a module when it matches the module's name or the name of any module above it:
excluding ``model.layers.3.self_attn`` (or ``re:model\\.layers\\.3\\.self_attn$``) excludes that
layer's ``self_attn.kv_b_proj`` too, because quantization tools skip a module's whole subtree.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

_GLOB_CHARS = frozenset("*?[")


class PatternKind(Enum):
    EXACT = "exact"
    REGEX = "re"
    GLOB = "glob"


def ancestors(module: str) -> tuple[str, ...]:
    """``"a.b.c"`` -> ``("a", "a.b", "a.b.c")``: the module and every module above it, outermost first."""
    parts = module.split(".")
    return tuple(".".join(parts[: i + 1]) for i in range(len(parts)))


@dataclass(frozen=True)
class Pattern:
    """One module-name pattern; build it with :meth:`parse`."""

    text: str
    kind: PatternKind
    _regex: re.Pattern[str] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def parse(cls, text: object, where: str) -> Pattern:
        """Parse ``text``; ``where`` names the config entry for error messages."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{where}: a module pattern must be a non-empty string, got {text!r}")
        if text.startswith("re:"):
            try:
                regex = re.compile(text[3:])
            except re.error as exc:
                raise ValueError(f"{where}: {text!r} is not a valid regular expression ({exc})") from None
            return cls(text, PatternKind.REGEX, regex)
        if _GLOB_CHARS & set(text):
            return cls(text, PatternKind.GLOB)
        return cls(text, PatternKind.EXACT)

    def matches(self, name: str) -> bool:
        """Does the pattern match this one name (no ancestors)?"""
        if self.kind is PatternKind.REGEX:
            assert self._regex is not None
            return self._regex.match(name) is not None
        if self.kind is PatternKind.GLOB:
            return fnmatch.fnmatchcase(name, self.text)
        return name == self.text

    def covers(self, module: str) -> bool:
        """Does the pattern match ``module`` or a module above it?"""
        return any(self.matches(name) for name in ancestors(module))

    def __str__(self) -> str:
        return self.text


def parse_patterns(items: object, where: str) -> tuple[Pattern, ...]:
    """A JSON list of patterns (``None`` = empty)."""
    if items is None:
        return ()
    if isinstance(items, str) or not isinstance(items, list):
        raise ValueError(f"{where} must be a list of module patterns, got {items!r}")
    return tuple(Pattern.parse(p, f"{where}[{i}]") for i, p in enumerate(items))


def covering(patterns: Iterable[Pattern], module: str) -> tuple[Pattern, ...]:
    """Every pattern that covers ``module``, in the given order."""
    return tuple(p for p in patterns if p.covers(module))


def first_covering(patterns: Iterable[Pattern], module: str) -> Pattern | None:
    """The first pattern that covers ``module``, or None."""
    return next((p for p in patterns if p.covers(module)), None)

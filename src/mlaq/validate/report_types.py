"""The report: a typed, frozen value that statistics build once and every reporter reads.

``stats.summarize`` returns a :class:`Report`; the terminal table, report.md, the plots and --fail-on
read it; JSON exists only at the edge (``Report.to_json``: what ``--json`` prints and report.json holds,
key for key as before). A section of a report is absent because its field is None (no noise floor, no
as-configured variant, no task suite, no servers), never because of which source measured it.

Frozen all the way down: the dataclass is frozen, every mapping inside it is a read-only view
(``types.MappingProxyType``) and every list a tuple; reading works as on the JSON object
(``report["schemes"]["mxfp4"]["kl"]``, ``report.get("noise_floor")``), assigning to a field, a key or an
item raises. ``to_json`` gives the lists back, so report.json is byte for byte what it was.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

Figures = Mapping[str, Any]  # one variant's figures (read-only)


def freeze(obj: Any) -> Any:
    """A read-only view of a JSON-shaped value: mappings become MappingProxyType, lists tuples (of
    frozen items); ``thaw`` is its inverse."""
    if isinstance(obj, Mapping):
        return MappingProxyType({k: freeze(v) for k, v in obj.items()})
    if isinstance(obj, list | tuple):
        return tuple(freeze(v) for v in obj)
    return obj


def thaw(obj: Any) -> Any:
    """The plain JSON value (dicts and lists) of a frozen one."""
    if isinstance(obj, Mapping):
        return {k: thaw(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [thaw(v) for v in obj]
    return obj


@dataclass(frozen=True, eq=False)  # equality as a mapping: equal to its JSON object
class Report(Mapping[str, Any]):
    """One validation's report. Fields in report.json's order; a None field: that part was not measured."""

    format_version: int
    source: str
    model: Mapping[str, Any]
    eval_text: Mapping[str, Any]
    config: Mapping[str, Any]
    seed: int
    versions: Mapping[str, str]
    buckets: tuple[tuple[int, ...], ...]
    reference: Figures
    noise_floor: Figures | None
    schemes: Mapping[str, Figures]
    as_configured: Figures | None
    theory: Mapping[str, Mapping[str, Any]]
    operands: Mapping[str, Mapping[str, float]]
    tasks: Mapping[str, Any] | None
    verdict_config: Mapping[str, Any]
    timings: Mapping[str, float]
    rows: tuple[tuple[str, Figures], ...] = field(init=False, repr=False, compare=False)
    servers: Mapping[str, Any] | None = field(init=False, repr=False, compare=False)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Report:
        """The report of a JSON object (report.json, or what ``summarize`` assembled), frozen."""
        names = list(cls._keys())
        missing = [n for n in names if n not in obj]
        if missing:
            raise ValueError(f"not an mlaq validate report: no {', '.join(missing)}")
        return cls(**{n: freeze(obj[n]) for n in names})

    def to_json(self) -> dict[str, Any]:
        """The plain JSON object: report.json and --json, key for key."""
        return {name: thaw(getattr(self, name)) for name in self._keys()}

    def __eq__(self, other: object) -> bool:  # equal to its JSON object (tuples read as the lists they were)
        if not isinstance(other, Mapping):
            return NotImplemented
        return self.to_json() == thaw(other)

    def __post_init__(self) -> None:
        # derived once, read as attributes: every reporter iterates ``rows``; ``servers`` is None unless
        # live servers were measured (then the report describes them, not a checkpoint)
        object.__setattr__(self, "rows", tuple(self.variants()))
        object.__setattr__(self, "servers", self.model.get("servers"))

    def variants(self) -> Iterator[tuple[str, Figures]]:
        """(row label, figures) in table order: reference, noise floor, schemes, as-configured."""
        yield f"{self.reference['name']} (reference)", self.reference
        if self.noise_floor:
            yield f"{self.noise_floor['name']} (noise floor)", self.noise_floor
        yield from self.schemes.items()
        if self.as_configured:
            yield "as-configured", self.as_configured

    # read as the JSON object reads: report["schemes"], report.get("noise_floor"), "tasks" in report
    def __getitem__(self, key: str) -> Any:
        if key not in self._keys():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    @classmethod
    def _keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.init)

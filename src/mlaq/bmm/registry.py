"""Scheme names -> scheme objects. Names follow vLLM's online-quantization shorthands."""

from __future__ import annotations

from mlaq.bmm.base import Bf16Reference, BmmScheme, Fp32Reference

_SCHEMES: tuple[type[BmmScheme], ...] = (Fp32Reference, Bf16Reference)


def scheme_names() -> tuple[str, ...]:
    return tuple(s.name for s in _SCHEMES)


def get_scheme(name: str) -> BmmScheme:
    """The scheme called ``name``; an unknown name is an error listing the known ones."""
    for cls in _SCHEMES:
        if cls.name == name:
            return cls()
    raise ValueError(f"unknown BMM scheme {name!r}; known schemes: {', '.join(scheme_names())}")

"""Absorbed-MLA batched-matmul schemes: exact emulations of what each engine computes."""

from mlaq.bmm.base import BmmScheme, PreparedWeight
from mlaq.bmm.registry import get_scheme, scheme_names

__all__ = ["BmmScheme", "PreparedWeight", "get_scheme", "scheme_names"]

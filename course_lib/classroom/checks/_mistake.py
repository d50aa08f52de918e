"""The one type for a hypothesised mistake, used by every checker that guesses what went wrong.

A checker computes what a known mistake would give on the same inputs; when the student's
output matches it (and not the reference), the checker names the mistake without reading
any source. How the mistaken output is computed differs by exercise, so a Mistake carries
either ``spec``, switches for a variant function (``_attn_hypotheses.sdpa_variant``), or
``output``, the mistaken output itself or a function giving it (notebooks 04-07).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Mistake:
    """One mistake: the diagnosis code (see DIAGNOSES), what to tell the student, how to reproduce it."""

    code: str
    message: str
    spec: dict[str, Any] = field(default_factory=dict)
    output: Any = None

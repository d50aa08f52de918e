"""A counter-example (:class:`Example`) as ``checks.hint`` shows it: the smallest input on which the student's
code and the reference differ, found by ``engine.example`` and carried on the verdict
(``details["counterexample"]``)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class Example:
    """One input (its named parts, shown as given) and the two outputs on it."""

    call: str                                        # "apply_rotary(x, cos, sin, offset=1)"
    inputs: list[tuple[str, torch.Tensor]]
    yours: torch.Tensor
    expected: torch.Tensor
    notes: list[tuple[str, torch.Tensor]] = field(default_factory=list)   # e.g. the reference's scores

    def text(self) -> str:
        lines = [f"The smallest input we found on which your code and the reference differ: {self.call}"]
        for name, value in self.inputs + self.notes:
            lines.append(f"{name} =")
            lines.extend("    " + row for row in _rows(value))
        rows = _side_by_side(self.yours, self.expected)
        width = rows[0].index("  |  ") if rows else 11
        lines.append("your output".ljust(width) + "  |  the reference")
        lines.extend(rows)
        return "\n".join(lines)


def _number(value: float, whole: bool = False) -> str:
    if whole:
        return f"{int(value):d}"
    if value != value:
        return "nan"
    return f"{value: .3f}" if abs(value) < 1e4 else f"{value: .2e}"


def _rows(value: torch.Tensor) -> list[str]:
    t = value.detach().cpu()
    whole = not t.is_floating_point()                          # masks and indices: show 0/1 and integers
    t = t.double()
    while t.dim() > 2 and t.shape[0] == 1:
        t = t[0]                                               # drop leading axes of size one
    if t.dim() == 0:
        return [_number(float(t), whole)]
    if t.dim() == 1:
        return ["[" + " ".join(_number(float(v), whole) for v in t) + " ]"]
    if t.dim() == 2:
        return ["[" + " ".join(_number(float(v), whole) for v in row) + " ]" for row in t]
    out = []
    for i, block in enumerate(t):
        out.append(f"[{i}]")
        out.extend("  " + row for row in _rows(block if not whole else block.int()))
    return out


def _side_by_side(yours: torch.Tensor, expected: torch.Tensor) -> list[str]:
    left, right = _rows(yours), _rows(expected)
    width = max((len(row) for row in left), default=0)
    left += [""] * (len(right) - len(left))
    right += [""] * (len(left) - len(right))
    return [f"{a.ljust(width)}  |  {b}" for a, b in zip(left, right)]


def first_difference(cases: Sequence[Callable[[], Example | None]]) -> Example | None:
    """Run the cases in order (smallest first); the first that returns an Example wins."""
    for case in cases:
        try:
            found = case()
        except Exception:  # noqa: BLE001 - the student's code raised on this input: try the next
            continue
        if found is not None:
            return found
    return None

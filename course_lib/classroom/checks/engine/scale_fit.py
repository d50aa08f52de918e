"""The factor a student's code puts on the scores where it is none of the mistakes we name (scores * 0.3, / d**0.25,
a size written into the code): found by a search, so the verdict can say which factor the code uses."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...verdict import fail
from .._student_code import matches

_GOLDEN = (math.sqrt(5) - 1) / 2


def fitted_factor(out: torch.Tensor, compute: Callable[[float], torch.Tensor], low: float = 1e-3,
                  high: float = 1e3) -> float | None:
    """The factor f in [low, high] with ``compute(f)`` matching ``out``, or None when none does: the distance is
    searched on a grid of log f, then refined around the grid's best point by golden sections."""
    target = out.detach().double()

    def distance(log_f: float) -> float:
        return float(((compute(math.exp(log_f)).double() - target) ** 2).nan_to_num(1e30).sum())

    grid = [math.log(low) + (math.log(high) - math.log(low)) * j / 48 for j in range(49)]
    best = min(range(len(grid)), key=lambda j: distance(grid[j]))
    a, b = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    for _ in range(40):                       # shrinks the bracket by 0.618 ** 40, about 1e-8
        c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
        a, b = (a, d) if distance(c) < distance(d) else (c, b)
    factor = math.exp((a + b) / 2)
    return factor if matches(out, compute(factor)) else None


@dataclass(frozen=True)
class ScaleFit:
    """One place a factor may sit: ``output(*args, factor)`` is the reference with ``factor`` there, ``right(*args)``
    the factor the exercise asks for (NaN where no factor there is right), and ``says`` the message, which may
    name {factor}, {right} and {what}."""

    output: Callable[..., Any]
    right: Callable[..., float]
    says: str


def fitted_scale(fit: ScaleFit, runs: list[tuple[tuple[Any, ...], str, torch.Tensor]], *,
                 held: Callable[[float], bool] | None = None) -> str | None:
    """The message for a factor that explains every run ((args, what, the student's output)), else None. A run
    whose output is the same whatever the factor (one key per query: its weight is 1) says nothing about it and
    is left out. ``held``: the runs are calls, in the order they were made, of one function, and ``held(factor)``
    says whether the function keeps that number between calls (``function.keeps_number``): a wrong factor that is
    the right one of an earlier call (of other sizes), and that the function holds, was kept from that call."""
    factors, telling = [], []
    for args, what, out in runs:
        try:
            if matches(fit.output(*args, 0.1), fit.output(*args, 10.0)):
                continue
            factor = fitted_factor(out, lambda f, args=args: fit.output(*args, f))
        except (RuntimeError, ValueError, IndexError):
            return None
        if factor is None:
            return None
        factors.append(factor)
        telling.append((args, what, out))
    runs = telling
    wrong = [i for i, (args, _, _) in enumerate(runs) if not math.isclose(factors[i], fit.right(*args), rel_tol=1e-3)]
    if not wrong:
        return None
    first = wrong[0]
    args, what, _ = runs[first]
    if held is not None:
        kept_factor([(runs[i][1], factors[i], fit.right(*runs[i][0])) for i in range(len(runs))], held)
    message = fit.says.format(what=what, factor=factors[first], right=fit.right(*args))
    right_elsewhere = [runs[i][1] for i in range(len(runs)) if i not in wrong]
    if right_elsewhere:
        message += (f" For {right_elsewhere[0]} your factor is right: it must follow the size of the inputs, so a "
                    f"number or another size is written into your code.")
    return message


def kept_factor(calls: list[tuple[str, float | None, float]], held: Callable[[float], bool]) -> None:
    """``kept_state`` where calls of one function, in the order they were made ((what, the factor found on its
    scores or None, the factor right there)), first go wrong with the factor that was right for an earlier call of
    other sizes, and the function holds that number (``held``): the factor was kept from that call, not computed
    again. A number written into the code gives the same outputs, but is not held between calls."""
    for place, (what, factor, right) in enumerate(calls):
        if factor is None or math.isclose(factor, right, rel_tol=1e-3):
            continue
        kept = next((said for said, _, earlier in calls[:place] if not math.isclose(earlier, right, rel_tol=1e-3)
                     and math.isclose(factor, earlier, rel_tol=1e-3)), None)
        if kept is not None and held(factor):
            fail("kept_state", f"{what}: your factor on the scores is {factor:.4g}, the one that is right for an "
                               f"earlier call ({kept}); here it should be {right:.4g}. Your code keeps the factor "
                               f"from an earlier call (a global, a cache, a default filled on the first call) "
                               f"instead of computing it from this call's inputs (their last axis) every time.")
        return

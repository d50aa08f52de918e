"""The record of one student attempt and the decorators that file attempts into a bank.

A bank module makes its own lists with ``BUGGY, CORRECT, bug, correct = new_bank()``: each decorated
function or class is filed under its own name, buggy ones with the diagnosis its checker must give, the
words the message must contain and, where a message once named a mistake the code does not make, words it must
not.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Attempt:
    exercise: str
    name: str
    candidate: Any
    expected: str | None                 # the diagnosis code, None for a correct attempt
    says: tuple[str, ...] = ()           # words the message must contain (case-insensitive)
    kwargs: dict = field(default_factory=dict)   # the checker's options (norm_first=False)
    avoids: tuple[str, ...] = ()         # words the message must not contain (a mistake the code does not make)

    @property
    def id(self) -> str:
        return f"{self.exercise}-{self.name}"


def new_bank() -> tuple[list[Attempt], list[Attempt], Callable[..., Any], Callable[..., Any]]:
    """(BUGGY, CORRECT, bug, correct): two empty lists and the decorators that fill them."""
    buggy: list[Attempt] = []
    good: list[Attempt] = []

    def bug(exercise: str, expected: str, *says: str, avoids: tuple[str, ...] = (), **kwargs: Any
            ) -> Callable[[Any], Any]:
        def register(candidate: Any) -> Any:
            buggy.append(Attempt(exercise, candidate.__name__, candidate, expected, says, kwargs, avoids))
            return candidate
        return register

    def correct(exercise: str, **kwargs: Any) -> Callable[[Any], Any]:
        def register(candidate: Any) -> Any:
            good.append(Attempt(exercise, candidate.__name__, candidate, None, (), kwargs))
            return candidate
        return register

    return buggy, good, bug, correct


def assert_judged(result: Any, attempt: Attempt) -> None:
    """The checker's verdict on ``attempt`` is the one the bank expects, with a message that names it."""
    if attempt.expected is None:
        assert result.passed, f"{attempt.id} rejected: {result}"
        return
    assert not result.passed, f"{attempt.id} passed: {result}"
    assert result.diagnosis == attempt.expected, f"{attempt.id}: {result}"
    assert len(result.message) > 30 and "Traceback" not in result.message
    for word in attempt.says:
        assert word.lower() in result.message.lower(), f"{attempt.id}: {word!r} not in {result.message!r}"
    for word in attempt.avoids:
        assert word.lower() not in result.message.lower(), f"{attempt.id}: {word!r} in {result.message!r}"

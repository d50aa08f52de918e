"""Make a signal land inside the reference guard's watcher, as a test of what happens then needs."""
from __future__ import annotations

from collections.abc import Callable
from types import CodeType

from course_lib.classroom.checks.engine import run


def raise_once_in_the_watcher(monkeypatch, code: Callable[[], CodeType], signal: Callable[[], BaseException]) -> list:
    """The guard's watcher raises ``signal()`` at the first call of ``code()`` (a function the test defines later, so
    asked for when the check runs), as a signal landing there would; calls then go on as before. Returns the list
    that records the landing. The watcher is the hook's default, and the function's calls are let through the hook's
    filter as a watched code's are."""
    watching, landed = run._watch, []

    def landing(watch, frame):
        if frame.f_code is code() and not landed:   # once: the signal is one signal
            landed.append(1)
            raise signal()
        return watching(watch, frame)
    monkeypatch.setattr(run._hook, "__defaults__", (landing,))
    watch_of = run._guard._watch_of

    def letting_through(self, stop):
        watch = watch_of(self, stop)
        return watch[:run._IDS] + (watch[run._IDS] | {id(code())},) + watch[run._IDS + 1:]
    monkeypatch.setattr(run._guard, "_watch_of", letting_through)
    return landed

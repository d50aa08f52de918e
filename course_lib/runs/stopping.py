"""Clean stops: SIGINT (Ctrl-C) and SIGTERM (SLURM's time limit, `kill`) become a request that the
training loop honours after its current step, so the run can save before it exits."""
from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

__all__ = ["StopRequest", "exit_status"]


def exit_status(signum: int) -> int:
    """The exit status after a clean stop on ``signum``: 128 + the signal number, the shell's
    convention (130 after Ctrl-C, 143 after SIGTERM), so schedulers see the run did not finish."""
    if isinstance(signum, bool) or not isinstance(signum, int) or signum <= 0:
        raise ValueError(f"signum: expected a signal number such as signal.SIGTERM, got {signum!r}")
    return 128 + int(signum)


class StopRequest:
    """A context manager that catches SIGINT and SIGTERM; call it to ask "should the loop stop?".

    The first signal only sets a flag. A second SIGINT raises KeyboardInterrupt, for the one
    who really wants out now (the last completed checkpoint stays intact: saves are atomic).
    Outside the main thread (where Python cannot install handlers) it never asks to stop.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)):
        if not isinstance(signals, (tuple, list)) or not all(isinstance(s, int) for s in signals):
            raise TypeError(f"signals: expected a tuple of signal numbers (signal.SIGINT, ...), got {signals!r}")
        self.signals = tuple(signals)
        self.signum: int | None = None
        # True while no step is running (a final evaluation): then any signal interrupts at once
        self.immediate = False
        self._previous: dict[int, Any] = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def __call__(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = self.signum is None
        self.signum = self.signum or signum
        if self.immediate or (not first and signum == signal.SIGINT):
            raise KeyboardInterrupt

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

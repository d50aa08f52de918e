"""A training run's folder: checkpoint.pt and metrics.json, checked before the first step and
always written as one consistent unit (the same run id and step in both)."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any

from torch import nn

from .._atomic import LockHeld, check_replaceable, hold_lock
from ..checkpoints import TMP_SUFFIX, remove_stale_temporaries, save_checkpoint, write_atomically

__all__ = ["RunFolder", "RunRefused", "CHECKPOINT", "METRICS", "LOCK", "command"]

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.json"
# Held (flock) for the whole run; it names the holder. The OS drops the lock when the holder's
# process ends, however it ends, so a file left by a dead run is simply taken over.
LOCK = ".course_lib-run.lock"


def command(option: str, folder: str | os.PathLike) -> str:
    """The command a message tells the reader to run for ``folder``, quoted for this system's shell (a path with
    spaces or other special characters pastes as one argument; Windows' cmd does not read POSIX quotes)."""
    quote = subprocess.list2cmdline([str(folder)]) if os.name == "nt" else shlex.quote(str(folder))
    return f"python -m course_lib train {option} {quote}"


class RunRefused(ValueError):
    """A run that cannot start: a bad argument, folder, corpus or device, found before any work."""


class SaveFailed(RunRefused):
    """A run that could not write its checkpoint or metrics (a full disk, a folder made read-only):
    the last checkpoint written is intact, and the command line shows this in one line."""


class RunFolder:
    """The folder ``--out`` names: checked now, written at every save.

    ``resume``: continue the run it holds. ``overwrite``: replace the run it holds (its files are
    removed before the first step, so no stale file can sit beside the new run's). Neither: a
    folder that already holds a run is refused, never silently replaced.
    """

    def __init__(self, path: str | os.PathLike, *, resume: bool = False, overwrite: bool = False):
        self.check_arguments(path, resume=resume, overwrite=overwrite)
        self.path = Path(path)
        self.resume = resume
        self.overwrite = overwrite
        self.run_id = uuid.uuid4().hex[:12]
        self._lock_fd: int | None = None
        self.previous_holder: str = ""   # what a dead run's lock file said, when one was taken over
        self.checkpoint_step: int | None = None   # the step of the checkpoint this run last wrote

    @staticmethod
    def check_arguments(path: Any, *, resume: Any, overwrite: Any) -> None:
        """Refuse what no folder could take, before anything is touched (a RunRequest checks so too)."""
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise RunRefused(f"{'resume' if resume else 'out'}: expected a folder path, got {path!r}")
        if resume and overwrite:
            raise RunRefused("overwrite: expected either --resume or --overwrite, got both")

    @property
    def checkpoint(self) -> Path:
        return self.path / CHECKPOINT

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    def holds_a_run(self) -> bool:
        return self.checkpoint.exists() or self.metrics.exists()

    def prepare(self) -> None:
        """Check the folder can take this run; create it; clear what a killed run left. Raises RunRefused."""
        if self.path.exists() and not self.path.is_dir():
            if self.resume:   # the folder came from --resume: name that option, not --out
                raise RunRefused(f"resume: expected a run folder holding {CHECKPOINT}, got the existing file "
                                 f"{self.path}; give --resume the folder a run wrote")
            raise RunRefused(f"out: expected a folder for {CHECKPOINT} and {METRICS}, got the existing "
                             f"file {self.path}; choose another --out")
        if self.resume and not self.checkpoint.is_file():
            raise RunRefused(f"resume: expected a run folder holding {CHECKPOINT}, got {self.path} "
                             f"({'missing' if not self.path.exists() else 'no ' + CHECKPOINT + ' in it'}); "
                             f"start a run with --out {self.path}")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            # mkdir succeeds on a read-only folder that exists: only a real write tells.
            fd, probe = tempfile.mkstemp(dir=self.path, prefix=".write-test.", suffix=TMP_SUFFIX)
            os.close(fd)
            os.remove(probe)
        except OSError as exc:
            raise RunRefused(f"out: expected a folder this process can write, got {self.path} "
                             f"({type(exc).__name__}: {exc.strerror or exc})") from None
        self._lock()
        # Safe now: no other run writes here while we hold the lock.
        remove_stale_temporaries(self.path)
        for target in (self.checkpoint, self.metrics):   # replaced at every save: found now, not after training
            try:
                check_replaceable(target)
            except ValueError as exc:
                raise RunRefused(f"out: {target.name} in {self.path} must be a file this run can replace at "
                                 f"every save; {str(exc).removeprefix('path: ')}") from None
        if self.holds_a_run() and not self.resume:
            if not self.overwrite:
                raise RunRefused(f"out: {self.path} already holds a run{self._describe()}; continue it with "
                                 f"--resume {self.path}, or replace it with --overwrite")

    def _lock(self) -> None:
        """Hold the folder for this run, or refuse naming the run that holds it."""
        if self._lock_fd is not None:
            return
        path = self.path / LOCK
        try:
            self._lock_fd, self.previous_holder = hold_lock(path)
        except LockHeld as held:
            raise RunRefused(f"out: {self.path} is in use by another run ({held.holder}); wait for it to end, "
                             f"stop it ({f'kill {held.pid}' if held.pid else 'kill it'}), or choose another "
                             f"--out") from None
        except OSError as exc:
            if getattr(exc, "stage", "") == "write":
                raise RunRefused(f"out: cannot write the lock file {path} ({exc.strerror or exc}); make room, or "
                                 f"choose another --out") from None
            raise RunRefused(f"out: cannot create the lock file {path} ({exc.strerror or exc}); "
                             f"choose another --out") from None

    def release(self) -> None:
        """Let another run use the folder (the lock file stays: removing it would race a waiting run)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)   # closing the descriptor drops the flock
            self._lock_fd = None

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # at interpreter shutdown os may already be gone; the OS drops the lock anyway
            pass

    def clear_replaced_run(self) -> None:
        """With ``overwrite``, remove the old run's files: call it once every other check has passed,
        so a refused run never costs the old one, and no old file sits beside the new run's."""
        if self.overwrite and not self.resume:
            for old in (self.metrics, self.checkpoint):
                old.unlink(missing_ok=True)

    def _describe(self) -> str:
        try:
            saved = json.loads(self.metrics.read_text())
            return f" (preset {saved.get('preset')!r}, step {saved.get('steps')}, {saved.get('status', 'finished')})"
        except (OSError, ValueError, AttributeError):
            return ""

    def save(self, model: nn.Module, tokenizer: Any, training: dict[str, Any], metrics: dict[str, Any]) -> None:
        """Write the checkpoint, then metrics.json, both stamped with this run's id and step.

        Each file is replaced atomically. If the process dies between the two renames,
        metrics.json still names the older step, and the run id and step tell the reader so;
        the checkpoint is what a resume trusts.
        """
        stamp = {"run_id": self.run_id, "step": training["step"]}
        training = {**training, **stamp}
        metrics = {**metrics, **stamp}
        save_checkpoint(self.checkpoint, model, tokenizer, extra={"preset": metrics.get("preset"),
                                                                  "val_loss": metrics.get("val_loss"),
                                                                  "steps": training["step"], **stamp},
                        training=training)
        self.checkpoint_step = training["step"]
        write_atomically(self.metrics, json.dumps(metrics, indent=2).encode("utf-8"))

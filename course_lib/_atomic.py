"""Writing a file so that readers see the old version or the new one, never half of one."""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

try:
    import fcntl
except ImportError:   # Windows: no advisory locks here; a folder is then not guarded
    fcntl = None

__all__ = ["atomic_file", "check_replaceable", "staging_prefix", "remove_stale_staging", "hold_lock", "LockHeld"]

# A staging name says which process writes it (".NAME.pid1234.abcd1234.tmp"), so a later run can tell one left
# by a killed run from one a live run is still writing. A stale one is removed only once it is this old: a
# process that has just died cannot be writing, but its pid could already belong to another process.
STALE_AFTER_S = 60.0
# Names without a pid (written by an older course_lib), or where a pid cannot be checked (Windows): an hour.
UNKNOWN_HOLDER_STALE_AFTER_S = 3600.0


def staging_prefix(name: str) -> str:
    """The start of the hidden name a file (or folder) called ``name`` is written under before its rename."""
    return f".{name}.pid{os.getpid()}."


def _holder_alive(pid: int | None) -> bool | None:
    """Whether process ``pid`` still runs (None: cannot tell here)."""
    if pid is None or os.name != "posix":
        return None
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)   # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except OSError:
        return True       # it exists, under another user
    return True


def remove_stale_staging(folder: str | os.PathLike, name: str, suffix: str = ".tmp") -> list[Path]:
    """Remove what a killed writer of ``folder/name`` left behind: its hidden ``.NAME.*SUFFIX`` staging files or
    folders, and only those whose process is gone (or, where that cannot be told, that are an hour old).

    Only this module's own naming pattern for that one ``name`` matches, never a user's ``.tmp``; a link is
    never followed or removed. Returns what was removed.
    """
    pattern = re.compile(rf"^\.{re.escape(name)}\.(?:pid(\d+)\.)?[a-z0-9_]{{8}}{re.escape(suffix)}$")
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    removed = []
    now = time.time()
    for entry in entries:
        match = pattern.match(entry.name)
        if match is None:
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISLNK(info.st_mode) or not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
            continue
        alive = _holder_alive(int(match.group(1)) if match.group(1) else None)
        age = now - info.st_mtime
        if alive or age < (STALE_AFTER_S if alive is False else UNKNOWN_HOLDER_STALE_AFTER_S):
            continue
        try:
            if stat.S_ISDIR(info.st_mode):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError:
            continue   # another run removed it first, or it is not ours to remove: leave it
        removed.append(Path(entry.path))
    return removed


def check_replaceable(target: Path) -> None:
    """Refuse a target that is neither absent nor a regular file: renaming over a device node, a
    FIFO, a socket or a folder would replace it with a plain file (or fail half-way)."""
    try:
        mode = os.lstat(target).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        try:
            mode = os.stat(target).st_mode
        except OSError:
            raise ValueError(f"path: expected a regular file (or a new name), got {target}, a link to "
                             f"nothing that can be read") from None
        if not stat.S_ISREG(mode):
            raise ValueError(f"path: expected a regular file (or a new name), got {target}, a link to "
                             f"something else")
        raise ValueError(f"path: expected a regular file (or a new name), got {target}, a symbolic link to "
                         f"{os.path.realpath(target)} (writing would replace the link, not the file it points "
                         f"to); remove the link, or choose another folder")
    if not stat.S_ISREG(mode):
        kind = ("a folder" if stat.S_ISDIR(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "a pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a special file")
        raise ValueError(f"path: expected a regular file (or a new name), got {target}, which is {kind}")


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", *, suffix: str = ".tmp") -> Iterator[IO]:
    """Open a temporary file beside ``path``; on a clean exit it replaces ``path`` in one rename.

    If the block raises (a failed download, a checksum that does not match, Ctrl-C), the
    temporary file is removed and ``path`` is left as it was. ``mode`` is "w" (UTF-8 text,
    "\\n" line endings) or "wb".
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"mode: expected 'w' or 'wb', got {mode!r}")
    target = Path(path)
    check_replaceable(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(target.parent, target.name, suffix)   # what a killed writer of this file left
    # Same folder as the target, so os.replace is a rename on one file system.
    fd, tmp = tempfile.mkstemp(prefix=staging_prefix(target.name), suffix=suffix, dir=target.parent)
    try:
        # mkstemp makes the file private (0600); give it the mode a plain open() would have.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with (os.fdopen(fd, "wb") if mode == "wb" else os.fdopen(fd, "w", encoding="utf-8", newline="\n")) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class LockHeld(Exception):
    """Another live process holds the lock: ``pid`` (None while it starts) and ``holder``, in words."""

    def __init__(self, pid: int | None, holder: str):
        super().__init__(holder)
        self.pid, self.holder = pid, holder


def _lock_holder(fd: int) -> tuple[int | None, str]:
    """(1234, 'PID 1234, started 2026-11-24T14:35:02+00:00'), from a lock file's contents."""
    try:
        saved = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
        pid = int(saved["pid"])
        return pid, f"PID {pid}, started {saved['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return None, "its PID is not written yet: it is starting"


def hold_lock(path: Path) -> tuple[int | None, str]:
    """Hold an exclusive flock on ``path`` (created if need be, never through a link) for as long as the returned
    descriptor stays open, and write this process's PID and start time into it. The OS drops the lock when the
    holder's process ends, however it ends, so a file left by a dead process is simply taken over.

    Returns (the descriptor, what the file said of its last holder, "" when empty); (None, "") where the OS has
    no flock. Raises :class:`LockHeld` naming a live holder, or the OSError of a file that cannot be made or
    written (its ``stage`` attribute: "create" or "write")."""
    if fcntl is None:
        return None, ""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as exc:
        exc.stage = "create"
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pid, holder = _lock_holder(fd)
        os.close(fd)
        raise LockHeld(pid, holder) from None
    previous = _lock_holder(fd)[1] if os.fstat(fd).st_size else ""
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "started": started}).encode("utf-8") + b"\n", 0)
    except OSError as exc:   # a disk that is full
        os.close(fd)
        exc.stage = "write"
        raise
    return fd, previous

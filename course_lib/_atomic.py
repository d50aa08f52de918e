"""Writing a file so that readers see the old version or the new one, never half of one."""
from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["atomic_file", "check_replaceable"]


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
        raise ValueError(f"path: expected a regular file (or a new name), got {target}, a symbolic link "
                         f"(writing would replace the link, not the file it points to); write to the "
                         f"file itself: {os.path.realpath(target)}")
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
    # Same folder as the target, so os.replace is a rename on one file system.
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent)
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

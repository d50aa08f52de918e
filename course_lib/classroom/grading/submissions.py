"""Finding the students' submissions in a folder, and reading them into memory.

Layouts understood (``SUBMISSIONS`` is the folder given to ``grade``):

- one folder per student holding that student's notebooks: ``SUBMISSIONS/ada/02_masked_attention.ipynb``;
- nbgrader's ``submitted/<student>/<assignment>/``: give ``submitted`` as ``SUBMISSIONS``; the
  notebooks of every assignment folder of a student are taken together (a name found in two
  assignments: the most recently modified is kept, and a note says so);
- a folder holding notebooks itself (Gradescope's ``/autograder/submission``): one student, named
  after the folder.

Every file is read now, before any student code runs anywhere, so that a submission changing
files on disk during the run (its own or another student's) cannot change what is graded. Hidden
files and folders, ``.ipynb_checkpoints``, ``__pycache__`` and symbolic links are skipped; so are
files over ``FILE_LIMIT`` bytes, files beyond ``STUDENT_LIMIT`` bytes or ``FILES_LIMIT`` files in all,
and the files of a folder named like a notebook (``02_masked_attention.ipynb/``), with a note.

Names are student text: each student's and each file's name is cleaned here, where it enters
(``text.name_from_student``: undecodable bytes replaced, control characters dropped, capped), and
two students whose cleaned names are the same are told apart by a number.

A student who can still write their folder while it is read (a live home on a JupyterHub) can swap a
folder for a link between the walk and the read: each file is therefore opened one path component at a
time below the student's folder, refusing a link in any of them (``O_NOFOLLOW``), without waiting on a
FIFO (``O_NONBLOCK``), and read only if the opened file is a regular one (``fstat``), within the limits.
"""
from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ... import _validate as validate
from .text import cap_lines, name_from_student

__all__ = ["Submission", "find_submissions", "FILE_LIMIT", "STUDENT_LIMIT", "safe_file_name"]

FILE_LIMIT = 25 * 2 ** 20
STUDENT_LIMIT = 100 * 2 ** 20
FILES_LIMIT = 500          # files read per student: a notebook course needs a handful
NOTES_LIMIT = 20           # notes kept per student
_SKIPPED_DIRS = {".ipynb_checkpoints", "__pycache__"}


@dataclass
class Submission:
    """One student's files (relative path -> bytes), and notes about what was skipped."""

    student: str
    files: dict[str, bytes] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def safe_file_name(student: str) -> str:
    """A file name for the student's feedback: letters, digits, ``.``, ``-`` and ``_``; the rest ``_``."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", student).strip(".") or "student"
    return name[:100]


def _visible(path: Path) -> bool:
    return not path.name.startswith(".") and path.name not in _SKIPPED_DIRS and not path.is_symlink()


def _walk(folder: Path, depth: int, skipped: list[str], top: Path) -> list[Path]:
    """The regular files under ``folder`` (not following links), at most ``depth`` folders down; a link or a
    special file (a FIFO) among them is named in ``skipped``, relative to ``top``, rather than left out unsaid."""
    found: list[Path] = []
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return found
    for entry in entries:
        if entry.name.startswith(".") or entry.name in _SKIPPED_DIRS:
            continue
        shown = "/".join(name_from_student(part) for part in entry.relative_to(top).parts)
        if entry.is_symlink():
            skipped.append(f"{shown} skipped: a link (the grader follows no link inside a submission)")
        elif entry.is_file():
            found.append(entry)
        elif entry.is_dir() and entry.suffix == ".ipynb":
            skipped.append(f"{shown} is a folder, not a notebook: its files were not read")
        elif entry.is_dir():
            if depth > 0:
                found += _walk(entry, depth - 1, skipped, top)
        elif entry.suffix == ".ipynb":
            skipped.append(f"{shown} skipped: not a regular file")
    return found


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_BY_DESCRIPTOR = bool(_NOFOLLOW) and os.open in os.supports_dir_fd and hasattr(os, "O_DIRECTORY")


class _NotRegular(OSError):
    """The opened file is not a regular file (a FIFO, a device, a folder)."""


def _open_below(top: Path, parts: tuple[str, ...]) -> int:
    """A descriptor for ``top/parts...``, each part opened relative to the one above with O_NOFOLLOW (a link in
    any part: OSError ELOOP or ENOTDIR), the file without blocking (a FIFO); ``top`` itself may be a link (a
    class folder of links to the students' homes)."""
    folder = os.open(top, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    try:
        for part in parts[:-1]:
            below = os.open(part, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=folder)
            os.close(folder)
            folder = below
        return os.open(parts[-1], os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | _CLOEXEC,
                       dir_fd=folder)
    finally:
        os.close(folder)


def _read_capped(top: Path, path: Path, room: int) -> tuple[int, bytes | None]:
    """(size, bytes) of the regular file ``path`` below ``top``, read with no link followed; bytes is None when
    the file is over ``room`` bytes (read no further than that)."""
    if not _BY_DESCRIPTOR:   # Windows: no O_NOFOLLOW nor dir_fd
        size = path.stat().st_size
        return size, (path.read_bytes() if size <= room else None)
    fd = _open_below(top, path.relative_to(top).parts)
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise _NotRegular("not a regular file")
        if status.st_size > room:
            return status.st_size, None
        os.set_blocking(fd, True)
        chunks, size = [], 0
        while size <= room:   # the file may grow after fstat: read one byte past the room at most
            chunk = os.read(fd, min(2 ** 20, room + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return size, (b"".join(chunks) if size <= room else None)
    finally:
        os.close(fd)


def _has_notebooks(folder: Path) -> bool:
    try:
        return any(p.suffix == ".ipynb" and _visible(p) and p.is_file() for p in folder.iterdir())
    except OSError:   # a folder the grader may not read: it holds nothing to grade
        return False


def _read_student(student: str, folder: Path) -> Submission:
    submission = Submission(student)
    if _has_notebooks(folder):
        roots = [folder]
    else:   # nbgrader: one folder per assignment
        roots = sorted(p for p in folder.iterdir() if _visible(p) and p.is_dir() and _has_notebooks(p))
    chosen: dict[str, Path] = {}
    skipped: list[str] = []
    for root in roots:
        for path in _walk(root, 2, skipped, root):
            name = "/".join(name_from_student(part) for part in path.relative_to(root).parts)
            if name in chosen:
                older, newer = sorted([chosen[name], path], key=lambda p: p.stat().st_mtime)
                submission.notes.append(f"{name} is in two places; graded {newer.parent.name}/{name}, "
                                        f"not {older.parent.name}/{name}")
                chosen[name] = newer
            else:
                chosen[name] = path
    submission.notes += skipped
    ordered = sorted(chosen.items(), key=lambda kv: (not kv[0].endswith(".ipynb"), kv[0]))
    if len(ordered) > FILES_LIMIT:
        submission.notes.append(f"{len(ordered)} files handed in: only the first {FILES_LIMIT} were read "
                                f"(notebooks first)")
        ordered = ordered[:FILES_LIMIT]
    total = 0
    for name, path in ordered:
        try:
            size, data = _read_capped(folder, path, min(FILE_LIMIT, STUDENT_LIMIT - total))
        except _NotRegular:
            submission.notes.append(f"{name} skipped: not a regular file")
            continue
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.ENOTDIR):
                submission.notes.append(f"{name} skipped: a link (the grader follows no link inside a submission)")
            else:
                submission.notes.append(f"{name} skipped: cannot be read ({err.strerror or err})")
            continue
        if data is None:
            submission.notes.append(f"{name} skipped: {size:,} bytes, over the grader's limit")
            continue
        submission.files[name] = data
        total += size
    submission.notes = cap_lines(submission.notes, NOTES_LIMIT, "notes")
    return submission


def find_submissions(folder: str | os.PathLike) -> list[Submission]:
    """Every student's submission in ``folder`` (see the module docstring), sorted by student."""
    root = validate.path("submissions", folder, "the folder of the students' submissions")
    if not root.is_dir():
        raise FileNotFoundError(f"SUBMISSIONS: expected a folder holding one folder per student, got '{root}' "
                                f"({'a file' if root.exists() else 'not found'})")
    if _has_notebooks(root):
        return [_read_student(name_from_student(root.resolve().name or "submission"), root)]
    found: list[Submission] = []
    taken: set[str] = set()
    # a student's folder may be a link (a class folder of links to the students' homes on a JupyterHub)
    for path in sorted(p for p in root.iterdir() if not p.name.startswith(".") and p.name not in _SKIPPED_DIRS
                       and p.is_dir() and not p.name.endswith(".ipynb")):
        name = base = name_from_student(path.name)
        number = 1
        while name.casefold() in taken:   # "Jos\xe9" and "Jos\xe8" from a zip both read "Jos\ufffd"
            number += 1
            name = f"{base} ({number})"
        taken.add(name.casefold())
        found.append(_read_student(name, path))
    return found

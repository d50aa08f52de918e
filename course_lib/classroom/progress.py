"""The live room, with no server: each check appends one line to a shared folder; ``progress`` reads it.

**Opt in.** Only when ``COURSE_PROGRESS_DIR`` names a folder (say, a shared folder on a JupyterHub
that the instructor created and made writable for the class) does each check append one JSON line
there::

    {"v": 1, "time": "2026-11-24T10:41:07Z", "student": "3f9c2a1b7e4d8c06", "exercise": "2.1",
     "passed": false, "diagnosis": "causal_mask"}

With the variable unset (or empty) nothing is written, anywhere: not even the anonymous id below.

**Who.** ``student`` is anonymous: a random id made once and kept in the per-user folder
(``~/.cache/attention-course/student-id`` on Linux, see ``corpora.user_data_dir``), so one
student's kernels share it; where that folder cannot be written, each kernel gets its own random
id. A student who wants to be named sets ``COURSE_STUDENT_NAME`` before starting Jupyter, or calls
``progress.set_name("Ada")`` in a notebook; the line then carries ``"name"`` too.

**What is recorded.** Every verdict of a checker on the exercise itself: a check of the name the
exercise defines (``causal_mask``, ``MaskedAttention``, ...), or of values (1.1's numbers, 8.1's
runs). The notebooks' demonstrations of planted bugs (``checks.check_masked_attention(BuggyAttention)``)
are not the student's attempts and are left out.

**No lost lines.** Each line is written with one ``os.write`` on a file opened with ``O_APPEND``,
one file per student id (``<id>.jsonl``): on a local file system the kernel appends each write
whole, so lines of several kernels never interleave (tested with concurrent writer processes). On
NFS, ``O_APPEND`` is not atomic across machines; one file per student keeps the writers of a file
to that student's own kernels.

Recording never raises and never changes the kernel's state (no random-number generator is
touched: the id comes from ``os.urandom``); a folder that cannot be written is reported once on
stderr and the check goes on.

``python -m course_lib progress DIR`` prints the room per exercise; ``--watch [SECONDS]`` redraws it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import stat
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._validate import describe
from .exercises import EXERCISES
from .verdict import DIAGNOSES

__all__ = ["PROGRESS_DIR_ENV", "NAME_ENV", "record", "set_name", "student_id", "ExerciseRoom", "read_room",
           "room_table", "main"]

PROGRESS_DIR_ENV = "COURSE_PROGRESS_DIR"
NAME_ENV = "COURSE_STUDENT_NAME"
ID_FILE = "student-id"
_ID_RE = re.compile(r"[0-9a-f]{16}")
NAME_LIMIT = 80
ROOM_FILE_LIMIT = 16 * 2**20   # bytes read of one student's file: far more than a day of checks (~200 bytes each)

# Kept in one dict mutated in place: the checks harness restores course_lib's module attributes
# around every check, and a dict that stays the same object keeps its contents through that.
_STATE: dict[str, Any] = {"id": None, "name": None, "warned": False, "subjects": None}


# ---------------------------------------------------------------- who

def set_name(name: str | None) -> None:
    """Be named in the room (``None``: anonymous again). Only this kernel; ``COURSE_STUDENT_NAME``
    names every kernel started from that environment."""
    if name is not None and (not isinstance(name, str) or not name.strip() or len(name.strip()) > NAME_LIMIT):
        raise ValueError(f"name: expected a non-empty str of at most {NAME_LIMIT} characters, or None, got {name!r}")
    _STATE["name"] = name.strip() if name is not None else None


def _name() -> str | None:
    if _STATE["name"]:
        return _STATE["name"]
    name = os.environ.get(NAME_ENV, "").strip()
    return name[:NAME_LIMIT] if name else None


def student_id() -> str:
    """This student's anonymous id: made once, kept in the per-user folder (see the module docstring)."""
    if _STATE["id"]:
        return _STATE["id"]
    from ..corpora import user_data_dir
    new = os.urandom(8).hex()
    found = None
    try:
        path = user_data_dir() / ID_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:   # made earlier (or by another kernel a moment ago)
            for _ in range(20):
                found = path.read_text(encoding="ascii", errors="replace").strip()
                if _ID_RE.fullmatch(found):
                    break
                time.sleep(0.01)   # another kernel is writing it now
        else:
            with os.fdopen(fd, "w", encoding="ascii") as handle:
                handle.write(new + "\n")
            found = new
    except OSError:
        found = None   # no per-user folder to keep it in: this kernel gets its own id
    _STATE["id"] = found if found and _ID_RE.fullmatch(found) else new
    return _STATE["id"]


# ---------------------------------------------------------------- writing

def _exercise_names() -> dict[str, str]:
    if _STATE["subjects"] is None:
        from .collect import course_exercises
        _STATE["subjects"] = {ex_id: ex.name for ex_id, ex in course_exercises().items()}
    return _STATE["subjects"]


def _append(folder: Path, entry: dict[str, Any]) -> None:
    """One line, one ``os.write`` on an ``O_APPEND`` file of this student's."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{PROGRESS_DIR_ENV}={folder} is not a folder (the instructor makes it)")
    line = (json.dumps(entry, ensure_ascii=True, separators=(",", ":")) + "\n").encode("ascii")
    fd = os.open(folder / f"{entry['student']}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, line)
        if written != len(line):   # a full disk: end the broken line so the next one stays whole
            os.write(fd, b"\n")
            raise OSError(f"only {written} of {len(line)} bytes written")
    finally:
        os.close(fd)


def record(result: Any, subject: str | None = None) -> None:
    """Append ``result`` (a CheckResult) to the live room when ``COURSE_PROGRESS_DIR`` is set. Never raises.

    ``subject`` is the ``__name__`` of what the check judged (its first argument), None when that has no
    name (1.1's numbers, 8.1's runs): a check of another name than the exercise's is a demonstration."""
    folder = os.environ.get(PROGRESS_DIR_ENV, "").strip()
    if not folder:
        return
    try:
        expected = _exercise_names().get(result.exercise)
        if subject and expected and subject != expected:
            return   # a demonstration (BuggyAttention, buggy_split_heads, ...), not the student's attempt
        entry = {"v": 1, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "student": student_id(),
                 "exercise": str(result.exercise), "passed": bool(result.passed),
                 "diagnosis": None if result.passed else result.diagnosis}
        name = _name()
        if name:
            entry["name"] = name
        _append(Path(folder), entry)
    except Exception as exc:  # the live room must never break a check
        if not _STATE["warned"]:
            _STATE["warned"] = True
            print(f"course_lib: the live room did not record this check ({type(exc).__name__}: {exc}); "
                  f"checks go on as usual.", file=sys.stderr)


# ---------------------------------------------------------------- reading

@dataclass
class ExerciseRoom:
    """One exercise in the room: who tried, who passes now, and what those failing now got."""

    exercise: str
    attempts: int = 0
    latest: dict[str, tuple[str, bool, str | None]] = field(default_factory=dict)   # student -> (time, passed, diagnosis)

    @property
    def students(self) -> int:
        return len(self.latest)

    @property
    def passing(self) -> int:
        return sum(passed for _, passed, _ in self.latest.values())

    def failing_now(self) -> Counter:
        return Counter(diagnosis or "?" for _, passed, diagnosis in self.latest.values() if not passed)


@dataclass
class Room:
    exercises: dict[str, ExerciseRoom]
    students: set[str]
    lines: int
    skipped: int
    last: str | None
    names: dict[str, str] = field(default_factory=dict)   # student id -> the name they chose (latest)

    def who(self, student: str) -> str | None:
        return self.names.get(student)


def _shown_name(value: Any) -> str | None:
    """A name as the room shows it: printable characters only (no terminal escapes), at most NAME_LIMIT."""
    if not isinstance(value, str):
        return None
    text = "".join(c for c in value if c.isprintable()).strip()[:NAME_LIMIT]
    return text or None


def _order(exercise_id: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in exercise_id.split("."))


def _room_file(path: Path) -> bytes | None:
    """The first ROOM_FILE_LIMIT bytes of ``path`` if it is a regular file, else None. The room's folder is writable
    by every student: a link (to /dev/zero), a FIFO or a folder named ``*.jsonl`` must not hang or flood this."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks, size = [], 0
        while size < ROOM_FILE_LIMIT and (chunk := os.read(fd, min(1 << 20, ROOM_FILE_LIMIT - size))):
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


_KNOWN = frozenset(entry.id for entry in EXERCISES)
_KNOWN_DIAGNOSES = frozenset(DIAGNOSES)


def read_room(folder: str | os.PathLike) -> Room:
    """Every ``*.jsonl`` line of ``folder``; lines that do not parse (a write in progress), or name an exercise
    or a diagnosis the course does not have, are skipped. Only regular files are read, each up to a limit."""
    from .. import _validate as validate
    root = validate.path("folder", folder, "the live room's folder")
    if not root.is_dir():
        raise FileNotFoundError(f"folder: expected the live room's folder (COURSE_PROGRESS_DIR), got '{root}' "
                                f"({'a file' if root.exists() else 'not found'})")
    exercises: dict[str, ExerciseRoom] = {}
    students: set[str] = set()
    names: dict[str, tuple[str, str]] = {}   # id -> (time, name)
    lines = skipped = 0
    last = None
    for path in sorted(root.glob("*.jsonl")):
        data = _room_file(path)
        if data is None:
            continue
        for raw in data.split(b"\n")[:-1]:   # the last piece has no newline yet: a write in progress
            lines += 1
            try:
                entry = json.loads(raw)
                student, exercise, passed = str(entry["student"]), str(entry["exercise"]), entry["passed"]
                stamp, diagnosis = _shown_name(entry["time"]), entry.get("diagnosis")
                if not isinstance(passed, bool) or exercise not in _KNOWN or stamp is None:
                    raise ValueError("passed, exercise or time")
                diagnosis = diagnosis if diagnosis in _KNOWN_DIAGNOSES else None
            except (ValueError, KeyError, TypeError, RecursionError):   # a student's line, nested deep enough
                skipped += 1
                continue
            who = student   # a name, when set, is only shown; the id is who it is
            name = _shown_name(entry.get("name"))
            if name and (who not in names or names[who][0] <= stamp):
                names[who] = (stamp, name)
            room = exercises.setdefault(exercise, ExerciseRoom(exercise))
            room.attempts += 1
            if who not in room.latest or room.latest[who][0] <= stamp:
                room.latest[who] = (stamp, passed, diagnosis)
            students.add(who)
            last = max(last or stamp, stamp)
    return Room(dict(sorted(exercises.items(), key=lambda kv: _order(kv[0]))), students, lines, skipped, last,
                {who: name for who, (_, name) in names.items()})


def _titles() -> dict[str, str]:
    return {entry.id: entry.title for entry in EXERCISES}


def room_table(room: Room, titles: dict[str, str] | None = None) -> str:
    """The room as a plain-text table, one row per exercise."""
    if not isinstance(room, Room):
        raise TypeError(f"room: expected a Room from read_room(...), got {describe(room)}")
    titles = _titles() if titles is None else titles
    head = (f"The room: {len(room.students)} student(s), {room.lines - room.skipped} check(s)"
            + (f", the last at {room.last}" if room.last else "")
            + (f"; {room.skipped} unreadable line(s) skipped" if room.skipped else ""))
    named = sorted({room.names[s] for s in room.students if s in room.names}, key=str.casefold)
    if named:
        anonymous = sum(1 for s in room.students if s not in room.names)
        head += f"\nNamed: {', '.join(named)}" + (f"; {anonymous} anonymous" if anonymous else "")
    if not room.exercises:
        return head + "\nNo checks recorded yet."
    rows = [("exercise", "title", "tried", "passing", "attempts", "most common mistake now (students)")]
    for ex_id, ex in room.exercises.items():
        failing = ex.failing_now()
        mistake = "-" if not failing else ", ".join(f"{d} {n}" for d, n in failing.most_common(3))
        stuck = sorted({room.names[s] for s, (_, passed, _) in ex.latest.items() if not passed and s in room.names},
                       key=str.casefold)
        if stuck:   # the students who chose to be named, failing now
            mistake += f" ({', '.join(stuck[:6])}{', ...' if len(stuck) > 6 else ''})"
        rows.append((ex_id, titles.get(ex_id, "")[:40], str(ex.students), str(ex.passing), str(ex.attempts),
                     mistake))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}  {d:>{widths[3]}}  {e:>{widths[4]}}  {f}"
             for a, b, c, d, e, f in rows]
    return "\n".join([head, *lines])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib progress",
                                     description="The live room: per exercise, who tried, who passes now, "
                                                 "and the most common mistake of those failing now.")
    parser.add_argument("folder", metavar="DIR", help="the folder the room's COURSE_PROGRESS_DIR names")
    parser.add_argument("--watch", nargs="?", type=float, const=5.0, metavar="SECONDS",
                        help="redraw every SECONDS (default 5) until Ctrl-C")
    args = parser.parse_args(argv)
    # time.sleep cannot wait inf or nan seconds (and a day is more than any room needs)
    if args.watch is not None and not 0 < args.watch <= 86400:
        parser.error(f"--watch: expected a number of seconds > 0 and at most 86400 (a day), got {args.watch:g}")
    try:
        titles = _titles()
        while True:
            text = room_table(read_room(args.folder), titles)
            if args.watch is None:
                print(text)
                return 0
            clear = "\033[2J\033[H" if sys.stdout.isatty() else ""
            print(f"{clear}{text}\n(every {args.watch:g} s; Ctrl-C to stop)", flush=True)
            time.sleep(args.watch)
    except (FileNotFoundError, ValueError) as exc:   # no such folder; an empty or unusable path
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0

"""Whose code is a frame, a file, a traceback: the student's, or the course's, torch's and the installed
libraries'. The harness blames the student for what their code raised, and itself for the rest."""
from __future__ import annotations

import functools
import os
import site
import sysconfig
import traceback

import torch

_LIBRARY_PREFIXES = tuple({os.path.realpath(path).replace("\\", "/") + "/" for key, path in sysconfig.get_paths().items()
                           if key in ("stdlib", "purelib", "platlib") and path})
# the course's own folder, where it really is: a student's code compiled under a made-up name that merely holds
# "/course_lib/" is not the course's
_COURSE_PREFIX = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")).replace(
    "\\", "/") + "/"
# torch, the user's site-packages and the interpreter's other site folders (Debian's and Ubuntu's system Python
# keeps the libraries apt installs, Jupyter's among them, in /usr/lib/python3/dist-packages, which sysconfig's
# paths leave out), wherever they are
_OTHER_PREFIXES = tuple(os.path.realpath(path).replace("\\", "/") + "/" for path in (
    os.path.dirname(torch.__file__), site.getusersitepackages(), *getattr(site, "getsitepackages", list)()) if path)


# Where code is not the student's: the course's folder first (the grader's sandbox takes these for its own rule)
COURSE_ROOT = _COURSE_PREFIX
OUTSIDE_STUDENT_ROOTS = (_COURSE_PREFIX, *_LIBRARY_PREFIXES, *_OTHER_PREFIXES)


# File names the student's code gave to code it made (compile, code.replace, a function's __code__), recorded by
# the grader's sandbox: that code is theirs whatever file it names (torch's, to pass for it). A claim only ever
# makes more code the student's, so claiming the course's own files gains nothing.
_CLAIMED: set[str] = set()


def claim_student_file(filename: str) -> None:
    _CLAIMED.add(filename)


def claimed_files() -> set[str]:
    """The course's record of the files claimed, the set itself (the grader's judge compares it with the sandbox's
    own record, which no code of the student's reaches)."""
    return _CLAIMED


def is_student_file(filename: str) -> bool:
    """Whether code from ``filename`` is the student's: not the course's, torch's, or an installed library's
    ("<your 02_masked_attention.ipynb, Exercise 2.1>", "<string>" and an IPython cell are the student's), or
    named by code the student's code made."""
    return filename in _CLAIMED or not _outside_student(filename)


@functools.lru_cache(maxsize=4096)   # the reference guard asks on every call of the reference's code
def _outside_student(filename: str) -> bool:
    if filename.startswith("<frozen"):
        return True
    return os.path.isabs(filename) and os.path.realpath(filename).replace("\\", "/").startswith(OUTSIDE_STUDENT_ROOTS)


# An exception the student's code raised is read through these: its class's name and its traceback from the slots
# themselves (a metaclass's __name__ property, a __traceback__ of its own are not run), its text through its own
# __str__ only inside a guard. Whatever its code raises, the verdict stays the student's, never "a bug in the course".
_CLASS_NAME = type.__dict__["__name__"].__get__
_TRACEBACK = BaseException.__traceback__.__get__
_ARGS = BaseException.__dict__["args"].__get__
_PLAIN = (str, int, float, bool, type(None))   # exact types whose str() runs nothing of the student's


def _frames(exc: BaseException) -> list[traceback.FrameSummary]:
    try:
        return list(traceback.extract_tb(_TRACEBACK(exc)))
    except BaseException:  # noqa: BLE001 - not an exception object at all: no frames to read
        return []


def exception_name(exc: BaseException) -> str:
    """The name of the exception's class, as the class itself holds it."""
    try:
        return _CLASS_NAME(type(exc))
    except BaseException:  # noqa: BLE001
        return "an exception"


def exception_message(exc: BaseException) -> str:
    """str(exc), or what its arguments say where its own __str__ raises (or they are not plain values: a note)."""
    try:
        text = str(exc)
        if type(text) is str:
            return text
    except BaseException:  # noqa: BLE001 - the student's __str__, whatever it raised
        pass
    try:
        args = _ARGS(exc)
        if all(type(arg) in _PLAIN for arg in args):
            return BaseException.__str__(exc)
    except BaseException:  # noqa: BLE001
        pass
    return "(its message cannot be read: turning it into text raised an error)"


def value_text(value: object, limit: int) -> str:
    """repr(value) cut to ``limit`` characters, or its class's name where its own repr raises."""
    try:
        text = repr(value)
        if type(text) is str:
            return text[:limit]
    except BaseException:  # noqa: BLE001 - the student's __repr__, whatever it raised
        pass
    return f"<a {_CLASS_NAME(type(value))} whose repr cannot be read>"


def exception_line(exc: BaseException) -> str:
    """'ValueError (line 12, in forward): the message', read without running the exception's own code."""
    return f"{exception_name(exc)}{student_frame(exc)}: {exception_message(exc)}"


def student_frame(exc: BaseException) -> str:
    """'line 12 in forward' for the innermost frame of the student's code, if any."""
    for frame in reversed(_frames(exc)):
        if is_student_file(frame.filename):
            return f" (line {frame.lineno}, in {frame.name})"
    return ""


def raised_in_student_code(exc: BaseException) -> bool:
    """Whether any frame of the traceback is the student's: the harness blames the student, or itself."""
    return any(is_student_file(frame.filename) for frame in _frames(exc))

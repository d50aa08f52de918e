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
# torch and the user's site-packages, wherever they are installed
_OTHER_PREFIXES = tuple(os.path.realpath(path).replace("\\", "/") + "/" for path in (
    os.path.dirname(torch.__file__), site.getusersitepackages()) if path)


@functools.lru_cache(maxsize=4096)   # the reference guard asks on every call of the reference's code
def is_student_file(filename: str) -> bool:
    """Whether code from ``filename`` is the student's: not the course's, torch's, or an installed library's
    ("<your 02_masked_attention.ipynb, Exercise 2.1>", "<string>" and an IPython cell are the student's)."""
    if filename.startswith("<frozen"):
        return False
    return not os.path.isabs(filename) or not os.path.realpath(filename).replace("\\", "/").startswith(
        (_COURSE_PREFIX, *_LIBRARY_PREFIXES, *_OTHER_PREFIXES))


def student_frame(exc: BaseException) -> str:
    """'line 12 in forward' for the innermost frame of the student's code, if any."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if is_student_file(frame.filename):
            return f" (line {frame.lineno}, in {frame.name})"
    return ""


def raised_in_student_code(exc: BaseException) -> bool:
    """Whether any frame of the traceback is the student's: the harness blames the student, or itself."""
    return any(is_student_file(frame.filename) for frame in traceback.extract_tb(exc.__traceback__))

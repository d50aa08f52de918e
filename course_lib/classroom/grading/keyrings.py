"""The kernel's keyrings, which neither bubblewrap nor a change of user replaces.

A process shares its session keyring with the one that started it, whatever its user: a student's code graded
from the instructor's shell could read, add to or revoke the instructor's keys (a Kerberos ticket cache, a disk
key). And a user's own keyrings outlive every process of that user: a key one student leaves there reaches the next
student, and the next run (the persistent keyring for three days by default). So a worker joins a new, empty
session keyring before any student code, and a worker with a user of its own (``isolation.BASE_UID`` + slot)
empties that user's keyrings, the persistent one too, before each student.
"""
from __future__ import annotations

import platform
import sys

_KEYCTL = {"x86_64": 250, "aarch64": 219, "arm64": 219}   # the keyctl system call's number
_JOIN_SESSION_KEYRING, _CLEAR, _GET_PERSISTENT = 1, 7, 22
_SESSION_KEYRING, _USER_KEYRING, _USER_SESSION_KEYRING = -3, -4, -5


def _keyctl(*args: int) -> int:
    number = _KEYCTL.get(platform.machine())
    if not sys.platform.startswith("linux") or number is None:
        return -1
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.syscall(ctypes.c_long(number), *(ctypes.c_long(arg) for arg in args)))


def own_session_keyring() -> None:
    """Leave the session keyring this process was started with for a new, empty one of its own."""
    _keyctl(_JOIN_SESSION_KEYRING, 0)


def clear_user_keyrings() -> None:
    """Empty this user's keyrings: the user and user-session keyrings, and the persistent one, which outlives
    them for days (found, and linked into this process's own session keyring, by its id). Only for a user of the
    grader's own: the instructor's are theirs."""
    persistent = _keyctl(_GET_PERSISTENT, -1, _SESSION_KEYRING)   # -1: this process's own user
    for keyring in (_USER_KEYRING, _USER_SESSION_KEYRING, *((persistent,) if persistent > 0 else ())):
        _keyctl(_CLEAR, keyring)

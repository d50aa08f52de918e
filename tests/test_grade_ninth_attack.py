"""A ninth attack on the grader (2026-11-29): what a student's code can make the grader say or do, and what the
grader's own limits do to the course's solutions.

- An exception whose own code raises when it is read (its __str__, its class's __name__, its __traceback__) made
  the verdict "checker_error: a bug in the course": the student chose it. It is read now without running any of
  its code, and stays the student's exception.
- The self-check graded the course's solutions without the run's memory limit, so a limit they cannot run in
  (Gradescope's 256 MB for notebook 05 alone) failed every student, the solved ones too, with "a bug in the
  course". The solutions now run under the limit a student's code gets, and the run stops before anyone is graded.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from course_lib.classroom import checks
from course_lib.classroom.checks._student_files import exception_line
from course_lib.classroom.grading import grading_plan, isolation
from course_lib.classroom.grading.judge import judge

UNREADABLE = '''
class _Quiet(Exception):
    def __str__(self):
        raise ValueError("internal assertion in course_lib: please report to the course maintainers")

class _Named(type):
    @property
    def __name__(cls):
        raise KeyError("course_lib reference table is corrupt (a bug in the course)")

class _Nameless(Exception, metaclass=_Named):
    pass

class _Lost(Exception):
    @property
    def __traceback__(self):
        raise RuntimeError("a bug in the course")
'''


@pytest.mark.parametrize("exercise,source", [
    ("1.1", UNREADABLE + "def my_prediction():\n    raise _Quiet()\n"),
    ("2.1", UNREADABLE + "def _boom():\n    raise _Quiet()\n\ndef causal_mask(n, _unused=_boom()):\n    return None\n"),
    ("2.1", UNREADABLE + "def causal_mask(n):\n    raise _Nameless('no')\n"),
    ("2.1", UNREADABLE + "def causal_mask(n):\n    raise _Lost('lost')\n"),
    ("2.1", UNREADABLE + "def causal_mask(n):\n    raise _Quiet(object())\n"),
], ids=["str-raises", "at-definition", "metaclass-name", "traceback-property", "unprintable-argument"])
def test_an_exception_that_cannot_be_read_is_still_the_students_exception(exercise, source, monkeypatch):
    monkeypatch.setenv("COURSE_CHECK_IN_PROCESS", "1")   # as in the grader's exercise process
    verdict = judge(grading_plan([exercise])[exercise], source)
    assert (verdict["passed"], verdict["diagnosis"]) == (False, "exception"), verdict
    assert "bug in the course" not in verdict["message"] and "corrupt" not in verdict["message"], verdict


def test_in_the_kernel_too_and_the_line_names_what_can_be_read():
    namespace: dict = {}
    exec(UNREADABLE, namespace)   # noqa: S102 - the student's classes, defined as a cell defines them

    def causal_mask(n):
        raise namespace["_Quiet"]("the message it was given")

    result = checks.check_causal_mask(causal_mask)
    assert (result.passed, result.diagnosis) == (False, "exception"), result
    assert "_Quiet" in result.message and "the message it was given" in result.message
    assert exception_line(namespace["_Nameless"]("x")).startswith("_Nameless")   # the class's own name
    assert "cannot be read" in exception_line(namespace["_Quiet"](object()))


def test_the_self_check_holds_the_solutions_to_the_runs_memory_limit():
    """In a fresh process, as a worker runs it: 1 MB above what it maps is too little for any check."""
    script = ("from course_lib.classroom.grading import grading_plan\n"
              "from course_lib.classroom.grading.selfcheck import self_check\n"
              "plans = grading_plan(['1.3', '2.1'])\n"
              "assert self_check(plans) == [] and self_check(plans, memory_mb=2048) == []\n"
              "for problem in self_check(plans, memory_mb=1):\n"
              "    print(problem)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    problems = done.stdout.splitlines()
    assert {p.split()[1] for p in problems} == {"1.3", "2.1"}, problems
    assert all("the course's solution failed under --memory-mb 1 (it passes without" in p for p in problems), problems


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64")
                    or os.geteuid() != 0, reason="the kernel's keyrings are Linux's; a user of the grader's own needs root")
def test_a_key_left_in_the_slot_users_persistent_keyring_is_gone_before_the_next_student():
    """The persistent keyring outlives every process of its user for days: a student could leave a key there for
    the next student in the slot, or the next run. A user the grader never gives out, so no real keyring is touched."""
    script = ("import ctypes, os\n"
              "from course_lib.classroom.grading import keyrings as k\n"
              f"os.setgid({isolation.BASE_UID + 97}); os.setuid({isolation.BASE_UID + 97})\n"
              "k.own_session_keyring()\n"
              "libc = ctypes.CDLL(None, use_errno=True)\n"
              "ring = k._keyctl(22, -1, -3)\n"   # KEYCTL_GET_PERSISTENT, linked into the session keyring
              "key = libc.syscall(ctypes.c_long(248), b'user', b'planted', b'left for the next student', "
              "ctypes.c_long(25), ctypes.c_long(ring))\n"   # add_key
              "held = lambda: k._keyctl(11, ring, 0, 0)\n"    # KEYCTL_READ: the bytes of its keys' ids
              "before = held()\n"
              "k.clear_user_keyrings()\n"
              "print(ring, key, before, held())\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    ring, key, before, after = map(int, out.stdout.split())
    assert ring > 0 and key > 0 and before > 0, out.stdout   # the key was planted
    assert after == 0, out.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"),
                    reason="seccomp filters are Linux's")
def test_below_python_the_kernel_refuses_memory_files_in_an_exercise_process(tmp_path):
    """memfd_create and a socket's buffers hold memory past the address-space limit (1.5 GB under --memory-mb 256
    through cffi, which raises no audit event; 3 GB in socket pairs). Kept from before the sandbox, as code past the audit hook would call it, the kernel
    now refuses it; cffi is refused at import."""
    script = ("import os\n"
              "from course_lib.classroom.grading import sandbox\n"
              "memfd = os.memfd_create   # the real one, as native code would reach it\n"
              f"sandbox.enter({str(tmp_path)!r}, [], memory_mb=None, cpu_seconds=None)\n"
              "said = []\n"
              "try:\n"
              "    memfd('held'); said.append('memfd allowed')\n"
              "except PermissionError:\n"
              "    said.append('memfd refused')\n"
              "import socket\n"
              "try:\n"
              "    socket.socketpair(); said.append('sockets allowed')\n"
              "except PermissionError:\n"
              "    said.append('sockets refused')\n"
              "try:\n"
              "    import cffi; said.append('cffi imported')\n"
              "except ImportError:\n"
              "    said.append('no cffi here')\n"
              "except PermissionError:\n"
              "    said.append('cffi refused')\n"
              "said.append('filtered' if 'Seccomp:\\t2' in open('/proc/self/status').read() else 'unfiltered')\n"
              "open('said.txt', 'w').write(' '.join(said))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    said = (tmp_path / "said.txt").read_text().split()
    assert said[:4] == ["memfd", "refused", "sockets", "refused"] and said[-1] == "filtered", said
    assert " ".join(said[4:6]) in ("cffi refused", "no cffi"), said


# A tenth attack (a re-attack of the ninth's fixes): the course's work bound to the exercise's name, the checks' own
# models of the answers, and student objects whose dunders are C callables (no frame of theirs when they raise).
@pytest.mark.parametrize("exercise,source,called", [
    ("5.2", "def lm_loss(logits, targets):\n    raise NotImplementedError\n"
            "from course_lib.train import _cross_entropy as lm_loss\n", "_cross_entropy"),
    ("12.3", "from course_lib.variants import linear_attention as linear_attention_recurrent\n", "linear_attention"),
    ("2.1", "def causal_mask(n):\n    from course_lib.classroom.checks._attn_hypotheses import allowed_pattern\n"
            "    return allowed_pattern(n)\n", "allowed_pattern"),
    ("4.1", "from course_lib.classroom.checks.notebook04 import _table\n\n"
            "def sinusoidal_table(max_tokens, embed_dim):\n    return _table(max_tokens, embed_dim)\n", "_table"),
    ("9.2", "from course_lib.classroom.checks._gqa_variants import rotary_variant\n\n"
            "def rotate_half(x):\n    x1, x2 = x.chunk(2, dim=-1)\n    return torch.cat([-x2, x1], dim=-1)\n\n"
            "def apply_rotary(x, cos, sin, offset=0):\n    return rotary_variant(x, cos, sin, offset, spec={}).to(x.dtype)\n",
     "rotary_variant"),
], ids=["bound-by-import", "bound-by-import-alone", "checks-pattern", "checks-table", "checks-variant"])
def test_the_courses_work_under_another_name_or_from_the_checks_is_calls_reference(exercise, source, called,
                                                                                  monkeypatch):
    monkeypatch.setenv("COURSE_CHECK_IN_PROCESS", "1")
    verdict = judge(grading_plan([exercise])[exercise], source)
    assert (verdict["passed"], verdict["diagnosis"]) == (False, "calls_reference"), verdict
    assert f"course's own {called}" in verdict["message"], verdict
    assert f"asks you to write {grading_plan([exercise])[exercise].name} yourself" in verdict["message"], verdict


@pytest.mark.parametrize("exercise,source,diagnosis", [
    ("1.1", "import functools\n\nclass Weights:\n    __repr__ = functools.partial(int, 'a bug in the course')\n\n"
            "def my_prediction():\n    return Weights(), 2.0\n", "dtype"),
    ("11.3", "import functools\n\nclass _Handle:\n    __getattr__ = functools.partial(int, 'a bug in the course')\n\n"
             "def ablate_head(model, layer, head):\n    return _Handle()\n", "exception"),
    ("2.2", "import functools\n\nclass _Layer:\n    __class__ = property(functools.partial(next, map(int, ['0'] + "
            "['a bug in the course'] * 50)))\n\nclass MaskedAttention:\n    def __new__(cls, *args, **kwargs):\n"
            "        return _Layer()\n", "exception"),
], ids=["repr", "getattr", "class-property"])
def test_a_dunder_that_is_a_c_callable_is_still_the_students_verdict(exercise, source, diagnosis, monkeypatch):
    monkeypatch.setenv("COURSE_CHECK_IN_PROCESS", "1")
    verdict = judge(grading_plan([exercise])[exercise], source)
    assert (verdict["passed"], verdict["diagnosis"]) == (False, diagnosis), verdict
    assert "bug in the course" not in verdict["message"], verdict


@pytest.mark.parametrize("exercise,source,called", [
    ("1.3", "from course_lib.classroom.checks._attn_hypotheses import attend\n\n"
            "def scaled_dot_product_attention(q, k, v, mask=None):\n"
            "    return attend(q, k, v, mask, scale=q.shape[-1] ** -0.5)\n", "attend"),
    ("3.1", "from course_lib.classroom.checks import _attn_hypotheses as h\n\n"
            "def split_heads(x, num_heads):\n    return h.split_heads_as(x, num_heads, 'ok')\n", "split_heads_as"),
    ("9.1", "from course_lib.classroom.checks._gqa_variants import tables\n\n"
            "def rope_tables(head_dim, max_tokens, theta=10000.0):\n"
            "    return tuple(t.float() for t in tables(head_dim, max_tokens, theta))\n", "tables"),
], ids=["attend", "split", "tables"])
def test_the_helpers_the_checks_build_their_answers_from_are_the_courses_work(exercise, source, called,
                                                                             monkeypatch):
    """An eleventh attack: the helpers under the checks' models of the answers passed where the models did not."""
    monkeypatch.setenv("COURSE_CHECK_IN_PROCESS", "1")
    verdict = judge(grading_plan([exercise])[exercise], source)
    assert (verdict["passed"], verdict["diagnosis"]) == (False, "calls_reference"), verdict
    assert f"course's own {called}" in verdict["message"], verdict


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.machine() != "x86_64",
                    reason="the system call numbers below are x86_64's")
def test_the_kernel_filter_refuses_what_holds_memory_or_makes_processes_and_lets_threads_run():
    """Shared memory segments outlive their process, and each new process has a memory limit of its own (4.5 GB
    held through native forks under a 384 MB limit): refused. Threads, which torch and the checks use, still run."""
    script = ("import ctypes, os, threading\n"
              "from course_lib.classroom.grading.syscalls import refuse_escapes\n"
              "libc = ctypes.CDLL(None, use_errno=True)\n"
              "assert refuse_escapes()\n"
              "said = []\n"
              "for name, number, args in (('shmget', 29, (0, 1 << 20, 0o1600)), ('fork', 57, ()),\n"
              "                           ('clone-process', 56, (17, 0, 0, 0, 0)), ('clone3', 435, (0, 0))):\n"
              "    result = libc.syscall(number, *args)\n"
              "    if result == 0:\n"
              "        os._exit(0)\n"
              "    said.append(f'{name}={result},{ctypes.get_errno()}')\n"
              "ran = []\n"
              "thread = threading.Thread(target=lambda: ran.append(1)); thread.start(); thread.join()\n"
              "import torch\n"
              "torch.set_num_threads(2)\n"
              "said.append(f'threads={len(ran)},{float((torch.ones(300, 300) @ torch.ones(300, 300))[0, 0]):.0f}')\n"
              "print(' '.join(said))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["shmget=-1,1", "fork=-1,1", "clone-process=-1,1", "clone3=-1,38",
                                   "threads=1,300"], done.stdout

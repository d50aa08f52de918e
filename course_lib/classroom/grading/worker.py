"""The grading worker: a process that never runs student code itself, and forks one child per exercise.

The grader starts a few of these (``--workers``) with ``python -m course_lib.classroom.grading.worker`` and
sends each, on stdin, one JSON line per student: the student's files (read into memory by the
grader before any student code ran), the exercises, the limits. The worker writes the files into
a fresh folder of its own, reads the student's definitions (parsing, never running them), and for
each exercise forks a child that enters the sandbox (``sandbox.enter``), runs the student's
definition and the course's check cell (``judge``), and sends its one verdict back on a pipe of
its own. The worker waits on that pipe with the exercise's time limit, then kills the child's
process group (and, on Linux, any process the child left behind: the worker is a subreaper), and
writes the grade to the grader on its stdout, a descriptor the children close before running
anything. Student code can thus only ever reach the pipe of its own exercise.

Time limit per notebook: a notebook's exercises share ``timeout`` seconds. Each exercise may use
an equal share of what is left when it starts, so the notebook never takes longer than
``timeout``, and one endless loop cannot starve the exercises after it.

Without ``os.fork`` (Windows), or with ``--inline``, the worker grades a single student in its own
process instead (the grader starts one per student): the same judging and sandbox policy, but no
per-exercise process, no resource limits, and only the grader's kill of the whole worker when the
student's total time runs out.
"""
from __future__ import annotations

import base64
import json
import os
import select
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["main", "exercise_limits"]

READ_LIMIT = 1 << 20   # bytes of a child's verdict: more is not a verdict


def exercise_limits(budget: float, elapsed: float, left: int) -> float:
    """The time an exercise may use: an equal share of what the notebook has left."""
    return max(0.0, budget - elapsed) / max(1, left)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


# JSON's escapes for a string, as a table for str.translate (a method of str itself, which no submission can
# replace): the quote, the backslash and every control character
_ESCAPES = {**{code: f"\\u{code:04x}" for code in range(0x20)}, ord('"'): '\\"', ord("\\"): "\\\\"}


def _sender(fd: int, token: str) -> Any:
    """``send(verdict)``: the verdict with the token, as one JSON object, written whole to ``fd``. Everything it
    uses is bound here, before the submission's code runs; a verdict is a dict of strings, booleans and None."""
    write, escapes, is_str, as_list = os.write, dict(_ESCAPES), str, list

    def text(value: Any) -> str:
        if value is True or value is False or value is None:
            return "true" if value is True else "false" if value is False else "null"
        # a lone surrogate (a submission's message may hold one) cannot be UTF-8: it becomes U+FFFD
        whole = is_str(value).encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        return '"' + whole.translate(escapes) + '"'

    def send(verdict: dict[str, Any]) -> None:
        fields = ",".join(text(key) + ":" + text(value) for key, value in as_list(verdict.items()))
        data = ('{"token":' + text(token) + ',"verdict":{' + fields + "}}").encode("utf-8")
        while data:
            data = data[write(fd, data):]
    return send


class _Channel:
    """The worker's line to the grader: JSON lines on a descriptor no child keeps, each with the token the
    grader sent first (held in ``send``'s closure, not on this object: a submission graded inline would have to
    dig it out of the garbage collector)."""

    def __init__(self, fd: int, token: str):
        self.fd = fd
        encode = json.dumps

        def send(message: dict[str, Any]) -> None:
            _write_all(fd, (encode({**message, "token": token}) + "\n").encode("utf-8"))
        self.send = send


def _become_subreaper() -> None:
    """Linux: orphans of our children are re-parented to us, so none outlives its exercise."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)   # PR_SET_CHILD_SUBREAPER
    except Exception:  # best effort: the process-group kill still applies
        pass


def _kill_strays() -> None:
    """Kill every child of this worker still there (a grandchild a submission left behind)."""
    for _ in range(20):
        pids: set[int] = set()
        for task in Path("/proc/self/task").glob("*/children") if os.path.isdir("/proc/self/task") else []:
            try:
                pids |= {int(p) for p in task.read_text().split()}
            except (OSError, ValueError):
                continue
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


def _describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        why = " (by itself, or by the system when it ran out of memory)" if name == "SIGKILL" else \
            " (the CPU-time limit)" if name in ("SIGXCPU",) else ""
        return f"was killed by {name}{why}"
    if os.WIFEXITED(status):
        return f"exited with status {os.WEXITSTATUS(status)} (os._exit, or a crash in native code)"
    return f"ended with wait status {status}"


def _run_child(plan: Any, source: str | None, home: str, deny: list[str], limit: float, memory_mb: int | None,
               close: list[int]) -> tuple[dict[str, Any], float]:
    """Fork a child to judge one exercise; its verdict (or why there is none) and the seconds it took."""
    from . import sandbox
    from .judge import judge
    # The child's verdict must carry this token: bytes a submission writes into the pipe on its own
    # (without digging the token out of its process's memory) are not taken for a verdict.
    token = os.urandom(16).hex()
    start = time.monotonic()
    try:
        read_end, write_end = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            os.close(read_end)
            os.close(write_end)
            raise
    except OSError as exc:   # processes or files the student's code left fill the sandbox's limits
        return {"exercise": plan.id, "passed": False, "diagnosis": "crashed",
                "message": f"The grader could not start this exercise's check ({exc.strerror or exc}): processes "
                           f"or open files that your code left behind fill the sandbox's limits. Do not start "
                           f"processes from your notebook's code."}, 0.0
    if pid == 0:   # the child: it never returns
        try:
            os.close(read_end)
            from ..checks._references import bind_references
            from ..checks.engine.run import set_time_limit
            bind_references(checkers_too=True)   # before any student code: the checkers are put back like the rest
            send = _sender(write_end, token)     # bound now, so no patch of json or os can write the verdict
            sandbox.enter(home, deny, memory_mb=memory_mb, cpu_seconds=limit, close=close)
            set_time_limit(max(0.5, 0.9 * limit))   # the checker's own timer rings first
            send(judge(plan, source))
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        os.setpgid(pid, pid)   # also here: the kill below must find the group even if the child is slow to start
    except OSError:
        pass
    chunks: list[bytes] = []
    size = 0
    timed_out = False
    while True:
        remaining = start + limit - time.monotonic()
        if remaining <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([read_end], [], [], remaining)
        if not ready:
            continue
        data = os.read(read_end, 65536)
        if not data:
            break
        chunks.append(data)
        size += len(data)
        if size > READ_LIMIT:
            break
    # A verdict may be complete while the child is still exiting: take it, then stop everything.
    seconds = time.monotonic() - start
    status = None
    if not timed_out:
        for _ in range(50):   # up to 0.5 s for a child that sent its verdict to exit on its own
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            status = None
            time.sleep(0.01)
    for kill, target in ((os.killpg, pid), (os.kill, pid)):   # the group, and the child should it have left it
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if status is None:
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            status = 0
    os.close(read_end)
    _kill_strays()
    try:
        sent = json.loads(b"".join(chunks)) if chunks and size <= READ_LIMIT else None
    except (ValueError, RecursionError):   # bytes the student's code wrote (nesting deep enough to recurse out)
        sent = None
    verdict = sent.get("verdict") if isinstance(sent, dict) and sent.get("token") == token else None
    if isinstance(verdict, dict) and verdict.get("exercise") == plan.id:
        return verdict, seconds
    if timed_out:
        return {"exercise": plan.id, "passed": False, "diagnosis": "timeout",
                "message": f"Stopped after {limit:.0f} s, this exercise's share of the notebook's time limit: "
                           f"look for a loop that never ends, or work that grows with every step."}, seconds
    if chunks:
        return {"exercise": plan.id, "passed": False, "diagnosis": "crashed",
                "message": "Your code wrote into the channel that carries the check's verdict back to the "
                           "grader, so no verdict could be read."}, seconds
    return {"exercise": plan.id, "passed": False, "diagnosis": "crashed",
            "message": f"The process running your code {_describe_status(status)} before the check finished: "
                       f"look for os._exit, os.kill or signal calls, or memory use far beyond the "
                       f"{memory_mb} MB limit."}, seconds


def _write_files(home: str, files: dict[str, str], notebooks: set[str]) -> dict[str, Any]:
    """Write the student's files into ``home``; returns the text of each course notebook found, by the
    course's name (a renamed copy, "02_masked_attention (1).ipynb", is written under it too), why a
    notebook was not found, and notes on which file was graded where several could be it."""
    from .sources import candidates, find_notebook, unfinished_exercises
    contents = {}
    for name, encoded in files.items():
        relative = Path(name)
        if relative.is_absolute() or ".." in relative.parts or not relative.parts:
            continue   # the grader sends plain relative names; anything else is not written
        data = base64.b64decode(encoded)
        try:
            target = Path(home, relative)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        except OSError:
            continue   # a name this system cannot hold: the file is not there, as if not handed in
        contents[relative.as_posix()] = data
    texts: dict[str, str] = {}
    why: dict[str, str] = {}
    notes: list[str] = []
    flat = [n for n in contents if "/" not in n]
    handed_in = {name: contents[name] for name in flat if name.endswith(".ipynb")}
    for notebook in sorted(notebooks):
        possible = candidates(flat, notebook)
        unfinished = {name: unfinished_exercises(contents[name].decode("utf-8", errors="replace"))
                      for name in possible} if len(possible) > 1 else {}
        found, note = find_notebook(flat, notebook, unfinished)
        if found is None:
            why[notebook] = note
            if possible:
                notes.append(note)
            continue
        if note:
            notes.append(note)
        texts[notebook] = contents[found].decode("utf-8", errors="replace")
        handed_in[notebook] = contents[found]
        if found != notebook:
            try:
                Path(home, notebook).write_bytes(contents[found])   # 8.1 collects by the course's names
            except OSError:
                pass   # a folder of theirs holds the name: 8.1 reads its notebooks from a fresh folder anyway
    return {"texts": texts, "why": why, "notes": notes, "handed_in": handed_in}


def _as_handed_in(home: str, notebooks: dict[str, bytes]) -> str:
    """A fresh folder inside ``home`` holding the student's notebooks as read at the start. ``home`` is the
    student's working folder, whose mode their earlier code may have changed (``os.chmod(".", 0o555)``): it is
    made writable for its owner again first; an OSError left is the student's (the caller's verdict)."""
    os.chmod(home, 0o700)
    folder = tempfile.mkdtemp(prefix="as-handed-in-", dir=home)
    for name, data in notebooks.items():
        try:
            Path(folder, name).write_bytes(data)
        except OSError:
            continue
    return folder


def _read_part(text: str | None, plan: Any, known: set[str], why: str) -> Any:
    """The student's part for ``plan``; whatever their notebook makes the parser do, a verdict of theirs."""
    from .sources import StudentPart, student_part
    try:
        return student_part(text, plan, known, missing_detail=why)
    except Exception as exc:  # their notebook (a parse bomb, say): never "a bug in the course"
        return StudentPart(plan.id, None, "exception",
                           f"Your {plan.notebook} could not be read for exercise {plan.id} ({type(exc).__name__}): "
                           f"look for a cell with code nested thousands of levels deep.")


def grade_student(job: dict[str, Any], send: Callable[[dict[str, Any]], None], *, inline: bool,
                  close: list[int]) -> None:
    """Grade one student's job; each grade is sent as soon as it is known."""
    from .judge import judge, known_names
    from .likeness import FLAG_SAME_AS_SOLUTION, fingerprint
    from .plan import CAPSTONE, grading_plan
    student = job["student"]
    plans = grading_plan(job["exercises"])
    known = known_names(plans)
    home = tempfile.mkdtemp(prefix="student-", dir=job["root"])
    try:
        try:
            found = _write_files(home, job["files"], {p.notebook for p in plans.values()})
        except Exception as exc:  # anything wrong with the student's files is that student's verdict
            found = {"texts": {}, "notes": [], "handed_in": {}, "why": {p.notebook: f"{p.notebook} could not be read from the "
                                                       f"submission ({type(exc).__name__})" for p in plans.values()}}
        for note in found["notes"]:
            send({"type": "note", "student": student, "note": note})
        by_notebook: dict[str, list] = {}
        for plan in plans.values():
            by_notebook.setdefault(plan.notebook, []).append(plan)
        # Every part is read before any of the student's code runs.
        parts = {plan.id: _read_part(found["texts"].get(plan.notebook), plan, known,
                                     found["why"].get(plan.notebook, ""))
                 for plan in plans.values() if plan.id != CAPSTONE}
        if inline:   # this process is the student's alone from here on: it runs their code itself
            from . import sandbox
            sandbox.enter_inline(home, job["deny"], memory_mb=job["memory_mb"])
        for group in by_notebook.values():
            start = time.monotonic()
            for index, plan in enumerate(group):
                part = parts.get(plan.id)
                if part is not None and part.source is None:
                    send({"type": "grade", "student": student, "exercise": plan.id, "seconds": 0.0,
                          "verdict": {"exercise": plan.id, "passed": False, "diagnosis": part.diagnosis,
                                      "message": part.message}})
                    continue
                source = part.source if part is not None else None
                limit = exercise_limits(job["timeout"], time.monotonic() - start, len(group) - index)
                # 8.1 reads the student's notebooks from disk: a fresh folder of them as handed in, never
                # the working folder, where the code of earlier exercises could have written other notebooks
                try:
                    where = _as_handed_in(home, found["handed_in"]) if plan.id == CAPSTONE else home
                except OSError as exc:   # their earlier code made the working folder unusable
                    send({"type": "grade", "student": student, "exercise": plan.id, "seconds": 0.0,
                          "verdict": {"exercise": plan.id, "passed": False, "diagnosis": "crashed",
                                      "message": f"8.1 could not copy your notebooks into your working folder "
                                                 f"({type(exc).__name__}: {exc}): code of an earlier exercise "
                                                 f"changed that folder or filled it. Remove that code."}})
                    continue
                if inline:   # only the checker's own timer here; the grader's kill of the whole process behind it
                    from ..checks.engine.run import set_time_limit
                    set_time_limit(max(0.5, 0.9 * limit))
                    began = time.monotonic()
                    os.chdir(where)
                    verdict = judge(plan, source)
                    os.chdir(home)
                    seconds = time.monotonic() - began
                else:
                    verdict, seconds = _run_child(plan, source, where, job["deny"], limit, job["memory_mb"], close)
                if part is not None and part.note and isinstance(verdict, dict) \
                        and isinstance(verdict.get("message"), str):
                    verdict = {**verdict, "message": f"{verdict['message']} {part.note}"}
                same = source is not None and fingerprint(source, plan.name) == job.get("fingerprints", {}).get(plan.id)
                send({"type": "grade", "student": student, "exercise": plan.id, "seconds": round(seconds, 3),
                      "verdict": verdict, "flag": FLAG_SAME_AS_SOLUTION if same else ""})
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _warm_up(exercises: list[str], *, check: bool = True, timeout: float | None = None,
             memory_mb: int | None = None) -> list[str]:
    """Import what the checks need and (``check``) grade the course's own solutions and learner copies
    here in the worker (``selfcheck``), so that each forked child starts with every import done and
    every lazy initialisation paid; returns the self-check's problems (none: the judge is sound)."""
    import torch
    torch.set_num_threads(1)   # before any torch work: a forked child must not inherit a thread pool
    from .plan import CAPSTONE, grading_plan
    plans = grading_plan(exercises)
    if any(p.notebook.startswith("07") for p in plans.values()):
        import transformers  # noqa: F401  (notebook 07's checks build GPT-2 models)
        from transformers import GPT2Config, GPT2LMHeadModel  # noqa: F401

        from ... import hf  # noqa: F401
    if CAPSTONE in plans:
        from .. import capstone  # noqa: F401
    from ..checks.engine.run import reference_of
    for exercise in plans:   # read once here, not in every forked child
        reference_of(exercise)
    # The device probe's meta tensors: torch imports its compiler (about a second, several on a busy machine) at the
    # first meta operation, which would otherwise count against the first student's time limit.
    meta = torch.empty(2, 1, device="meta")
    torch.cat([meta, meta], dim=-1)
    if not check:
        from .judge import course_namespace
        course_namespace()
        return []
    from .selfcheck import self_check
    return self_check(plans, timeout, memory_mb)


def _option(argv: list[str], name: str, kind: Callable[[str], Any]) -> Any:
    """The value of ``name=VALUE`` among the worker's arguments, as ``kind``; None when it is not there."""
    return next((kind(a.split("=", 1)[1]) for a in argv if a.startswith(f"{name}=")), None)


def main(argv: list[str] | None = None) -> int:
    """``python -m course_lib.classroom.grading.worker EXERCISES [--inline] [--isolated [--uid=N]]``: EXERCISES is
    "1.1,1.2,...". ``--isolated``: inside the grader's bubblewrap sandbox (``isolation``), for one
    student; the grader ran the self-check elsewhere, so this one only imports what the checks need."""
    argv = sys.argv[1:] if argv is None else argv
    isolated = "--isolated" in argv
    if isolated:   # before anything else: an unprivileged user with a process limit, no inherited descriptor
        from .isolation import enter_worker
        uid = _option(argv, "--uid", int)
        enter_worker(uid)
    inline = "--inline" in argv or not hasattr(os, "fork")
    exercises = next((a for a in argv if not a.startswith("--")), "").split(",")
    first = sys.stdin.buffer.readline()   # the grader's token, before anything else is read or run
    try:
        token = str(json.loads(first)["token"])
    except (ValueError, KeyError, TypeError):
        return 1
    channel = _Channel(os.dup(1), token)
    os.dup2(2, 1)   # whatever a library prints goes to the worker's log, never into the channel
    try:
        problems = _warm_up(exercises, check=not (isolated or "--checked" in argv),
                            timeout=_option(argv, "--timeout", float), memory_mb=_option(argv, "--memory-mb", int))
        _become_subreaper()
    except Exception as exc:  # the grader reports this as grading itself failing
        channel.send({"type": "error", "message": f"{type(exc).__name__}: {exc}"})
        return 1
    if problems:   # never a class graded against a broken judge
        channel.send({"type": "self_check", "problems": problems})
        return 1
    alone = False
    if not inline:
        from .zygote import alone_in_sandbox, seal
        seal()
        alone = isolated and alone_in_sandbox()
    channel.send({"type": "ready", "pid": os.getpid()})
    if inline or (isolated and not alone):   # one student per process (per sandbox, where it cannot be swept)
        return _grade_next(channel, inline=inline)
    # This process (isolated: the sandbox's zygote, torch and the course imported) never reads a student's
    # job. Each student is read and graded by a fresh child forked from it, so nothing of one student is
    # ever in the memory another's code runs in; after each, what the student left is swept away
    # (``zygote``) before the grader is told (``idle``) that the next student's job may be sent.
    while True:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _become_subreaper()
                code = _grade_next(channel, inline=False)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        _kill_strays()
        if isolated:
            from .zygote import sweep
            if not sweep():   # a process or a file we could not remove: the sandbox goes, with all in it
                return 1
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1
        if code != 0:   # no more students (NO_MORE), our error, or the child was killed: the grader sees us go
            return 0 if code == NO_MORE else 1
        channel.send({"type": "idle"})


NO_MORE = 3   # a child's exit status: stdin ended, no student to grade


def _grade_next(channel: _Channel, *, inline: bool) -> int:
    """Read one student's job from stdin and grade it; 0 when graded, NO_MORE at the end of stdin."""
    line = sys.stdin.buffer.readline()
    if not line:
        return NO_MORE
    job = json.loads(line)
    if not inline:   # this process grades this one student: bound it, and all it forks, before parsing anything
        from .sandbox import bound_worker
        notebooks = len({name.split(".")[0] for name in job["exercises"]})
        bound_worker(job["memory_mb"], job["timeout"] * notebooks + 60)
    try:
        grade_student(job, channel.send, inline=inline, close=[channel.fd])
    except Exception as exc:  # a bug of ours: the grader marks the student's remaining exercises
        channel.send({"type": "error", "message": f"{type(exc).__name__}: {exc}"})
        return 1
    channel.send({"type": "done", "student": job["student"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The grader's side: worker processes, the students handed to them, and every way a student can fail.

The grader (this process) never imports or runs student code. It keeps ``workers`` worker processes
busy (``python -m course_lib.classroom.grading.worker``, each in a session of its own, with an
allow-listed environment), hands each one student's files as one JSON line, and reads the grades
back as JSON lines. A student is graded in a process that held no other student: the worker stays, and a
fresh child it forks, before reading anything, reads and grades each student, so nothing of one student is
left in the memory another's code runs in; the next student is sent only once the worker says ``idle``
(isolated: every process of the last student killed, the writable folders emptied: ``zygote``). One more worker, first,
grades the course's own notebooks (``selfcheck``); no student is graded before it passed. A grade
is taken only for an exercise of the student being graded, and only once; anything else on the
line is ignored. Whatever happens to a worker while it grades a student, the run goes on:

- the worker stops answering within the student's total time (every notebook's ``timeout``, plus
  a margin): it is killed, and the exercises not graded yet get ``timeout``;
- it dies (a submission got past the sandbox and killed it): the exercises not graded yet get
  ``crashed``, and a new worker takes its place;
- it reports an error of its own (a bug in the grader): the exercises not graded yet get
  ``checker_error``, and the run's exit status says that grading failed.

Without ``os.fork`` (Windows) each student gets a fresh worker that grades in its own process
(``--inline``): no per-exercise processes and no resource limits there, only the total time.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .grades import Grade, grade_from_message
from .plan import ExercisePlan
from .submissions import NOTES_LIMIT, Submission
from .text import from_student

__all__ = ["GradingOptions", "GradingFailed", "SelfCheckFailed", "grade_submissions", "forks"]

START_TIMEOUT = 600.0     # seconds for a worker to import torch and warm up, on a very busy machine
MARGIN = 30.0             # seconds per student beyond the notebooks' limits, for the worker's own work


def forks() -> bool:
    """True where each exercise runs in a forked, limited child (Linux, macOS)."""
    return hasattr(os, "fork") and sys.platform != "win32"


class GradingFailed(RuntimeError):
    """Grading itself failed (a worker could not start, or reported an error of the grader's)."""


class SelfCheckFailed(GradingFailed):
    """The course's own solutions did not all pass, or a blank exercise passed: nobody is graded."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        limits = all(problem.startswith("timeout:") for problem in problems)   # the run's limit, not the course
        super().__init__("the grader's self-check failed, so nobody was graded ("
                         + ("the limits given are too tight" if limits else "a bug in the course or in this "
                            "installation") + "): grading the course's own notebooks,\n  " + "\n  ".join(problems))


@dataclass(frozen=True)
class GradingOptions:
    workers: int
    timeout: float          # seconds per notebook
    memory_mb: int | None   # address space per exercise, above what torch and the course map
    deny: tuple[str, ...]   # folders no submission may read: the submissions, the report, our root
    root: str               # the grader's private working folder (workers' folders go inside)
    inline: bool = False    # grade each student in a fresh worker's own process (forced without fork)
    isolated: bool = False  # each student's worker in a bubblewrap sandbox of its own (``isolation``)
    fingerprints: dict = field(default_factory=dict)   # exercise -> the course solution's ``likeness.fingerprint``
    stubs: str | None = None   # isolated: the course's notebooks without solutions, mounted for the worker


@dataclass
class _Outcome:
    grades: dict[str, Grade] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


# What an unisolated worker keeps of the grader's environment (isolated: ``isolation.worker_environment``):
# where things are, the locale, the data folder; never a token or a password of the instructor's shell.
KEPT_VARIABLES = ("PATH", "HOME", "TMPDIR", "TEMP", "TMP", "LANG", "LC_ALL", "LC_CTYPE", "SYSTEMROOT", "WINDIR",
                  "USERPROFILE", "APPDATA", "LOCALAPPDATA", "PATHEXT", "COMSPEC", "VIRTUAL_ENV", "CONDA_PREFIX",
                  "COURSE_DATA_DIR", "HF_HOME", "XDG_CACHE_HOME", "MPLCONFIGDIR", "LD_LIBRARY_PATH")


def worker_environment() -> dict[str, str]:
    """An unisolated worker's whole environment: :data:`KEPT_VARIABLES` and the grader's settings."""
    import course_lib
    package_parent = str(Path(course_lib.__file__).resolve().parent.parent)
    env = {key: value for key, value in os.environ.items() if key in KEPT_VARIABLES}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", MPLBACKEND="Agg",
               PYTHONPATH=os.pathsep.join([package_parent, *filter(None, [os.environ.get("PYTHONPATH")])]))
    return env


_LIVE: set = set()            # the workers running now, to stop them all on Ctrl-C
_LIVE_LOCK = threading.Lock()


class _Worker:
    """One worker process and a thread that turns its stdout into messages."""

    def __init__(self, exercises: list[str], options: GradingOptions, number: int, *, checked: bool = True):
        self.log = Path(options.root, f"worker-{number}.log")
        command = [sys.executable, "-m", "course_lib.classroom.grading.worker", ",".join(exercises)]
        if checked:
            command.append("--checked")   # the self-check ran in a worker of its own
        else:   # the self-check's worker: the course's solutions must fit the time and memory a student gets
            command.append(f"--timeout={options.timeout!r}")
            if options.memory_mb:
                command.append(f"--memory-mb={options.memory_mb}")
        if options.inline or not forks():
            command.append("--inline")
        cwd = options.root
        if options.isolated:
            from . import isolation
            command.append("--isolated")
            if os.geteuid() == 0:
                command.append(f"--uid={isolation.BASE_UID + number}")
            env = isolation.worker_environment({})
            command = isolation.command(command, notebooks=options.stubs)
            cwd = "/"
        else:
            env = worker_environment()
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=cwd, env=env,
                start_new_session=forks(),
                creationflags=getattr(subprocess, "CREATE_NEW_PROCESS_GROUP", 0) if not forks() else 0)
        # Every message the worker sends carries this token, which it reads first, before any student's code
        # runs: a line a submission writes into the channel on its own (inline, its code runs in the worker)
        # is no message.
        self.token = secrets.token_hex(16)
        self.process.stdin.write((json.dumps({"token": self.token}) + "\n").encode("utf-8"))
        self.process.stdin.flush()
        self.messages: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        with _LIVE_LOCK:
            _LIVE.add(self)

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                message = json.loads(line)
            except (ValueError, RecursionError):
                continue   # not ours: ignored
            if isinstance(message, dict) and message.pop("token", None) == self.token:
                self.messages.put(message)
        self.messages.put(None)   # end of the stream: the worker is gone

    def next(self, deadline: float) -> dict[str, Any] | None | bool:
        """The next message; None when the worker is gone; False when ``deadline`` passed."""
        try:
            return self.messages.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return False

    def wait_ready(self) -> None:
        message = self.next(time.monotonic() + START_TIMEOUT)
        if isinstance(message, dict) and message.get("type") == "ready":
            return
        self.stop()
        if isinstance(message, dict) and message.get("type") == "self_check":
            raise SelfCheckFailed([str(p) for p in message.get("problems", [])])
        why = message.get("message") if isinstance(message, dict) else "no answer" if message is False \
            else "it exited"
        raise GradingFailed(f"a grading worker did not start ({why}); its log:\n{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def send(self, job: dict[str, Any]) -> bool:
        try:
            self.process.stdin.write((json.dumps(job) + "\n").encode("utf-8"))
            self.process.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, wait: float = 5.0) -> None:
        with _LIVE_LOCK:
            _LIVE.discard(self)
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass
        if forks():
            try:
                os.killpg(self.process.pid, signal.SIGKILL)   # the worker and anything left in its session
            except (ProcessLookupError, PermissionError):
                pass
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def _job(submission: Submission, exercises: list[str], options: GradingOptions) -> dict[str, Any]:
    return {"student": submission.student, "exercises": exercises, "timeout": options.timeout,
            "memory_mb": options.memory_mb, "fingerprints": options.fingerprints, "root": "/tmp" if options.isolated else options.root,
            "deny": [] if options.isolated else list(options.deny),   # isolated, none of them is there
            "files": {name: base64.b64encode(data).decode("ascii") for name, data in submission.files.items()}}


def _grade_one(worker: _Worker, submission: Submission, plans: dict[str, ExercisePlan],
               options: GradingOptions) -> tuple[_Outcome, bool]:
    """Grade one student on ``worker``; the outcome, and whether the worker can take another student."""
    outcome = _Outcome()
    exercises = list(plans)
    notebooks = {plan.notebook for plan in plans.values()}
    deadline = time.monotonic() + options.timeout * len(notebooks) + MARGIN
    ended = "done"
    if not worker.send(_job(submission, exercises, options)):
        ended = "gone"
    while ended == "done":
        message = worker.next(deadline)
        if message is False:
            ended = "late"
            break
        if message is None:
            ended = "gone"
            break
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == "done" and message.get("student") == submission.student:
            break
        if kind == "error":
            outcome.errors.append(f"{submission.student}: {from_student(message.get('message'), 500, lines=3)}")
            ended = "error"
            break
        if kind == "note" and message.get("student") == submission.student and isinstance(message.get("note"), str):
            note = from_student(message["note"], 500, lines=3)
            if note not in submission.notes and len(submission.notes) < NOTES_LIMIT:
                submission.notes.append(note)
            continue
        if kind == "grade" and message.get("student") == submission.student:
            exercise = message.get("exercise")
            if exercise in plans and exercise not in outcome.grades:
                grade = grade_from_message(submission.student, exercise, message.get("verdict"),
                                           message.get("seconds"), message.get("flag", ""))
                if grade is None:
                    grade = Grade(submission.student, exercise, False, "crashed",
                                  "The grader received no well-formed verdict for this exercise.", 0.0)
                outcome.grades[exercise] = grade
    while_text = {"late": ("timeout", f"Grading your submission ran past its total time limit ({options.timeout:g} s "
                                      f"per notebook) while running this exercise, so it was stopped."),
                  "gone": ("crashed", "The process grading your submission died while running this exercise "
                                      "(os._exit, os.kill or a signal in your code, or memory)."),
                  "error": ("checker_error", "The grader itself failed on this exercise (a bug in the course); "
                                             "please report it.")}
    first = True
    for exercise in exercises:
        if exercise not in outcome.grades:
            diagnosis, text = while_text.get(ended, ("crashed", "No verdict came back for this exercise."))
            if not first:
                text = "Not graded: " + {"timeout": "the time limit ran out on an earlier exercise.",
                                         "crashed": "the process died on an earlier exercise.",
                                         "checker_error": "the grader failed on an earlier exercise."}[diagnosis]
            outcome.grades[exercise] = Grade(submission.student, exercise, False, diagnosis, text, 0.0)
            first = False
    # Inline: a fresh worker per student. Otherwise the worker (isolated: the sandbox's zygote) forks a fresh
    # child per student and never reads a job itself, so it may take the next student once it says ``idle``:
    # every process the student left is gone and (isolated) its writable folders are empty, so the next job is never
    # in the sandbox while anything of this student still runs there.
    reusable = ended == "done" and not (options.inline or not forks()) and _idle(worker)
    return outcome, reusable


IDLE_TIMEOUT = 60.0   # seconds for a worker to clear away what a student left


def _idle(worker: _Worker) -> bool:
    """Whether ``worker`` says it is ready for the next student (else it is stopped by the caller)."""
    message = worker.next(time.monotonic() + IDLE_TIMEOUT)
    return isinstance(message, dict) and message.get("type") == "idle" and worker.alive()


def grade_submissions(submissions: list[Submission], plans: dict[str, ExercisePlan], options: GradingOptions,
                      on_student: Callable[[Submission, list[Grade]], None] = lambda s, g: None
                      ) -> tuple[list[Grade], list[str]]:
    """Grade every submission on ``options.workers`` workers; every grade, and grading errors (if any)."""
    exercises = list(plans)
    todo: queue.Queue = queue.Queue()
    for submission in submissions:
        todo.put(submission)
    grades: list[Grade] = []
    errors: list[str] = []
    lock = threading.Lock()
    stopped: list[SelfCheckFailed] = []
    judged = threading.Event()   # set once the course's own notebooks were graded right: students may start

    def self_check() -> None:
        """Isolated workers do not check the judge themselves: one worker outside does, first."""
        try:
            checker = _Worker(exercises, dataclasses.replace(options, isolated=False), len(submissions) + 1,
                              checked=False)
            checker.wait_ready()
            checker.stop()
        except SelfCheckFailed as exc:
            stopped.append(exc)
        except GradingFailed as exc:
            stopped.append(SelfCheckFailed([f"the self-check could not run: {exc}"]))
        finally:
            judged.set()

    # Every worker grades one student; one more, first, grades the course's own notebooks. With one slot the
    # slot's worker starts once the self-check's has gone (Gradescope's 768 MB holds one worker, ~380 MB with
    # torch and the course imported, beside the grader, not two; on half a CPU starting both at once saves
    # nothing); with several slots they start together.
    one_slot = min(options.workers, len(submissions)) == 1
    threading.Thread(target=self_check, daemon=True).start()

    def slot(number: int) -> None:
        worker: _Worker | None = None
        try:
            while not stopped:
                try:
                    submission = todo.get_nowait()
                except queue.Empty:
                    return
                if worker is not None and not worker.alive():   # died between students: not this one's doing
                    worker.stop()
                    worker = None
                if worker is None:
                    if one_slot:   # the self-check's worker goes first: the two never hold memory together
                        judged.wait()
                        if stopped:
                            todo.put(submission)
                            return
                    worker = _Worker(exercises, options, number)
                    worker.wait_ready()
                judged.wait()
                if stopped:
                    todo.put(submission)
                    return
                outcome, reusable = _grade_one(worker, submission, plans, options)
                if not reusable:
                    worker.stop()
                    worker = None
                ordered = [outcome.grades[ex] for ex in exercises]
                with lock:
                    grades.extend(ordered)
                    errors.extend(outcome.errors)
                    on_student(submission, ordered)
        except SelfCheckFailed as exc:
            with lock:
                stopped.append(exc)
        except GradingFailed as exc:
            with lock:
                errors.append(str(exc))
        finally:
            if worker is not None:
                worker.stop()

    threads = [threading.Thread(target=slot, args=(n,), daemon=True) for n in range(min(options.workers,
                                                                                           len(submissions)))]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()
    except KeyboardInterrupt:   # the workers run in sessions of their own: Ctrl-C does not reach them
        with _LIVE_LOCK:
            running = list(_LIVE)
        for worker in running:
            worker.stop(wait=0)
        raise
    if stopped:
        raise stopped[0]
    graded = {g.student for g in grades}
    for submission in submissions:   # students no worker could take (every worker failed to start)
        if submission.student not in graded:
            grades += [Grade(submission.student, ex, False, "checker_error",
                             "Not graded: no grading worker could start.", 0.0) for ex in exercises]
    return grades, errors

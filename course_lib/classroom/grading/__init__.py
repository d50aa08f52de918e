"""Grading a class's notebooks, and seeing which mistakes the room makes.

``python -m course_lib grade SUBMISSIONS --out REPORT`` (or :func:`grade`) grades every student's
notebooks with the course's own checkers and writes ``REPORT/grades.csv``, ``summary.md`` and
``summary.png`` (the class view: per exercise, how many passed and which mistakes, with what to
tell the room), and ``feedback/<student>.md``; ``--format gradescope`` adds Gradescope's
``results.json``. The live room (``course_lib.classroom.progress``) is the same view while the class works.

How a submission is run, and what it cannot do:

- ``submissions``: every student's files are read into memory first (nothing is read back from
  disk later, so a submission rewriting files cannot change what is graded);
- ``sources``: per exercise, only the student's definition and what it names (helpers, imports,
  constants) is taken from their notebook, by parsing it; nothing else of the notebook runs;
- ``worker``/``sandbox``: worker processes, a fresh child of one per student, which never run student
  code, fork one child per exercise in a fresh folder holding only that student's files, with a time limit (a notebook's
  exercises share ``timeout``), a memory limit, and an audit-hook policy against reading other
  submissions or the report, writing outside its folder, starting processes or signalling others;
- ``selfcheck``: before anyone is graded, the course's solution notebooks and learner copies are
  graded; a solution that fails or a blank that passes stops the run (``SelfCheckFailed``);
- ``judge``: the child runs the definition, then the course's own check cell (read from the
  solution notebook, ``plan``), and sends its one verdict back on its own pipe;
- ``pool``: the grader hands students to workers and takes only well-formed verdicts for the
  student and exercise it asked for; a timeout, a crash or a killed worker becomes that student's
  ``timeout`` / ``crashed`` and never stops the run;
- ``isolation``: where bubblewrap runs (Linux with ``bwrap``), each worker runs in a sandbox of its
  own: no other process, no network, nothing of the disk but the system, Python and the course
  read-only, and a size-limited scratch folder; an unprivileged user with a process limit; everything
  it started dies with it. Its notebooks are parsed in there too. ``zygote``: the sandbox's worker
  imports torch once and forks a fresh child per student; between two students every process left
  in the sandbox is killed and every folder a student can write (``/tmp``, ``/dev``) is emptied;
- ``text``: student text (names, file names, messages, notes) is cleaned where it enters and escaped
  where it is written; ``likeness``: a part equal to the course's solution is flagged, not failed;
  ``checks.engine.run``'s reference guard: the exercise's own reference is out of the student's reach;
- ``report``/``gradescope``: written by the grader alone, at the end, whole into a hidden staging folder and
  swapped in by renames: an interrupted run leaves the previous report as it was, never two runs mixed.

What it does not guarantee: a submission runs in its own process and can, with deliberate
effort, tamper with that process (and so with its own verdicts, say by patching the checkers
from its definition's code): read the code of a pass that surprises you. Isolated, that is all
it can do. Not isolated (no bwrap: macOS, Windows, a machine without it; the run says so at the
start and in summary.md), the audit hook is a tripwire for the ordinary ways out, not a
kernel-enforced wall: a deliberate submission can then read and change what the grader's user
can reach, other students' grades included. On Windows there is no fork: each
student is graded in one fresh process of its own, with the policy but no per-exercise process
and no memory limit, and a total time limit only.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..._atomic import remove_stale_staging, staging_prefix
from . import isolation
from .grades import Grade
from .likeness import fingerprint
from .plan import CAPSTONE, ExercisePlan, default_exercises, grading_plan
from .pool import GradingOptions, forks, grade_submissions
from .report import RunInfo, claim_report_folder, hold_report_folder, release_report_folder, write_report
from .sources import candidates
from .submissions import Submission, find_submissions

WORK = "course-grade-work"   # the hidden work folder of a run in the temporary folder: .course-grade-work.pidN.*.d

__all__ = ["grade", "GradeRun", "Grade", "ExercisePlan", "grading_plan", "default_exercises", "find_submissions",
           "CAPSTONE"]


@dataclass
class GradeRun:
    """What a run produced: every grade, the report's files, grading's own errors, and its wall time."""

    grades: list[Grade]
    written: list[Path]
    errors: list[str]
    seconds: float
    submissions: list[Submission]


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def handed_in(submission: Submission, plans: dict[str, ExercisePlan]) -> set[str]:
    """The exercises of the notebooks a submission holds (by name or renamed copy): what Gradescope
    scores it on when no exercises were chosen (a one-notebook submission: that notebook's)."""
    names = [name for name in submission.files if "/" not in name]
    return {plan.id for plan in plans.values() if candidates(names, plan.notebook)}


def grade(submissions: str | os.PathLike, out: str | os.PathLike, *, workers: int | None = None,
          timeout: float = 60.0, memory_mb: int | None = 2048, exercises: list[str] | None = None,
          gradescope: bool = False, inline: bool = False, isolate: bool | None = None,
          on_student: Callable[[Submission, list[Grade]], None] | None = None,
          on_start: Callable[[int], None] | None = None) -> GradeRun:
    """Grade every submission in ``submissions`` and write the report into ``out``.

    ``workers``: students graded at once (default: the machine's cores); ``timeout``: seconds per
    notebook; ``memory_mb``: memory per exercise (None: no limit); ``exercises``: ids (default:
    every exercise with an exercise cell, 1.1-7.2 and 9.1-11.3; 8.1, which trains two models per
    student, only when asked for); ``gradescope``: also write results.json (with ``exercises`` None, each student scored on
    the exercises of the notebooks they handed in);
    ``inline``: grade each student in one fresh process, as on Windows; ``isolate``: each student's
    worker in a bubblewrap sandbox of its own (``isolation``): None (default) where bwrap runs here,
    True to require it (``RuntimeError`` where it cannot run), False for the process sandbox only.
    """
    from ... import _validate as validate
    root_in = validate.path("submissions", submissions, "the folder of the students' submissions").resolve()
    report = validate.path("out", out, "the report's folder").resolve()
    workers = (os.cpu_count() or 1) if workers is None else validate.positive_int("workers", workers)
    timeout = validate.positive_float("timeout", timeout)
    if memory_mb is not None:
        validate.positive_int("memory_mb", memory_mb)
    if isinstance(exercises, str):
        raise TypeError(f"exercises: expected a list of exercise ids such as ['2.1', '2.2'], got {exercises!r}")
    if _inside(report, root_in) or _inside(root_in, report):
        raise ValueError(f"out: expected a folder outside the submissions (and not holding them), got '{report}' "
                         f"for submissions in '{root_in}'")
    if isolate is not None and not isinstance(isolate, bool):
        raise TypeError(f"isolate: expected True, False or None (where available), got {isolate!r}")
    isolated, isolation_line = isolation.status() if isolate is not False else (False, "not isolated: turned off")
    if isolate and not isolated:
        raise RuntimeError(f"isolate: expected bubblewrap to run here, but it does not ({isolation_line})")
    plans = grading_plan(exercises)
    if CAPSTONE in plans:
        _require_corpora_for_capstone()
    found = find_submissions(root_in)
    if not found:
        raise FileNotFoundError(f"submissions: expected one folder per student (or notebooks) in '{root_in}', "
                                f"found none")
    lock = hold_report_folder(report)   # one run at a time writes a report folder
    try:
        claim_report_folder(report)
        if on_start is not None:
            on_start(len(found))
        start = time.monotonic()
        # a run killed with SIGKILL leaves its work folder (the stub notebooks, the workers' logs): named by its
        # pid, so that the next run removes it once that process is gone
        remove_stale_staging(tempfile.gettempdir(), WORK, suffix=".d")
        work = tempfile.mkdtemp(prefix=staging_prefix(WORK), suffix=".d")
        try:
            stubs = None
            if isolated:   # what the sandbox sees of the course's notebooks: every solution taken out
                from ...course_files import course_notebooks
                from .stubs import write_stub_notebooks
                stubs = str(write_stub_notebooks(course_notebooks(), Path(work, "notebooks")))
            options = GradingOptions(workers=workers, timeout=timeout, memory_mb=memory_mb,
                                     deny=(str(root_in), str(report), work), root=work,
                                     inline=inline or not forks(), isolated=isolated, stubs=stubs,
                                     fingerprints={p.id: fingerprint(p.solution, p.name) for p in plans.values()})
            grades, errors = grade_submissions(found, plans, options, on_student or (lambda s, g: None))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        seconds = time.monotonic() - start
        sandbox = ("each exercise in its own limited process" if not options.inline
                   else "each student in one fresh process (no fork here: no per-exercise process or memory limit)")
        sandbox = f"{sandbox}; {isolation_line}"
        notes = [f"{s.student}: {note}" for s in found for note in s.notes]
        if CAPSTONE not in plans:
            notes.append("8.1 (train your GPT) was not graded; add it with --exercises all (10 to 20 s more per student)")
        info = RunInfo(len(found), min(workers, len(found)), timeout, memory_mb, seconds, sandbox, notes, errors,
                       {s.student: list(s.notes) for s in found},
                       {s.student: handed_in(s, plans) for s in found} if exercises is None else {})
        written = write_report(report, grades, info, gradescope=gradescope)
        return GradeRun(grades, written, errors, seconds, found)
    finally:
        release_report_folder(lock)


def _require_corpora_for_capstone() -> None:
    """8.1 trains on both corpora: without them every student, the course's solution included, would
    fail it through no fault of theirs. Refuse before grading anyone, with the fix."""
    from ...corpora import CORPORA, locate_corpus
    missing = [location for location in map(locate_corpus, CORPORA) if not location.ok]
    if missing:
        where = "; ".join(f"{m.name}: {'wrong checksum at ' + str(m.path) if m.path else 'not found'}"
                          for m in missing)
        raise FileNotFoundError(f"exercises: 8.1 trains on the course's corpora, which are not all here ({where}); "
                                f"run `python -m course_lib data` (or set COURSE_DATA_DIR to the folder that "
                                f"holds them), or grade without 8.1")

"""The report: ``grades.csv``, ``summary.md`` and ``summary.png`` for the class, ``feedback/<student>.md``.

Everything is written by the grader at the end of the run, from the grades it received from its
workers (never from a file a submission could have touched). The folder is the grader's: a folder
holding a ``grades.csv``, ``summary.md``, ``feedback/`` ... that a previous ``grade`` did not write (it
leaves a ``.course-grade-report`` marker) is refused rather than overwritten; other files in it are
left alone, so ``--out`` may be Gradescope's results folder.

A report is whole, or says in every file a reader opens that it is not, and two runs are never mixed:
every file is first written into a hidden staging folder inside ``out``
(``.course-grade-report.pidNNN.xxxxxxxx.tmp``); only when all are written does the run swap them in, by
renames, with Ctrl-C and SIGTERM held off meanwhile. First the previous report's files (all of them, a
``results.json`` or ``gradescope/`` this run does not write included) are moved out, ``summary.md`` first,
and where the new report has that file a stub that says "report incomplete" takes its place
(``summary.md``, ``grades.csv``, ``results.json``, and a ``REPORT-INCOMPLETE.md`` in ``feedback/`` and
``gradescope/``); then the new files replace the stubs, ``summary.md`` last. So a SIGKILL inside the swap leaves each file either new and whole, or a stub saying
the report is incomplete (``summary.md`` says so until the very end), never one of the old report beside a
new one. A run interrupted before the swap leaves the previous report exactly as it was. What an
interrupted run leaves hidden is removed by a later run (once its writer is gone:
``_atomic.remove_stale_staging``). The marker says how the last run ended (``state``: ``grading``,
``replacing``, ``whole``).

Student text (names, messages, notes) is escaped where it is written into Markdown (``text``): it
reads as text, never as a heading, a link, an image or an HTML comment of its own. A file that cannot
be written does not stop the others: the failure is named in ``summary.md`` and in the run's errors.
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..._atomic import LockHeld, atomic_file, hold_lock, remove_stale_staging, staging_prefix
from ..exercises import exercise_order
from ..verdict import DIAGNOSES
from .advice import exercise_title, first_hint, room_hint
from .grades import Grade
from .gradescope import results_json
from .submissions import safe_file_name
from .text import cap_lines, markdown_block, markdown_inline

__all__ = ["RunInfo", "check_report_folder", "claim_report_folder", "write_report", "report_state", "grades_csv", "summary_markdown",
           "feedback_markdown", "summary_figure", "figure_styles", "spreadsheet_safe", "MARKER", "COLUMNS"]

MARKER = ".course-grade-report"
COLUMNS = ("student", "exercise", "passed", "diagnosis", "message", "seconds", "flag")
SUMMARY_NOTES_LIMIT = 200   # lines of notes in summary.md
OURS = ("grades.csv", "summary.md", "summary.png", "results.json", "feedback", "gradescope")
SWAP_ORDER = ("feedback", "gradescope", "results.json", "summary.png", "grades.csv", "summary.md")   # summary last
INCOMPLETE = "report incomplete"   # what every stub says, first
STAGING = "course-grade-report"   # the hidden folders a run writes its report into (and moves the old one to)
# A test hook: "POINT:PATH" makes a run that reaches POINT (a file's name once written into staging, "staged",
# "swapping": the old report moved out and stubs in, or "in:NAME": the new NAME swapped in) create PATH and
# wait there until PATH is removed, so that a test can interrupt it at that point.
PAUSE_VARIABLE = "COURSE_GRADE_TEST_PAUSE"


@dataclass
class RunInfo:
    """How the run went, for the summary's first lines."""

    students: int
    workers: int
    timeout: float
    memory_mb: int | None
    seconds: float
    sandbox: str
    notes: list[str] = field(default_factory=list)    # files skipped, notebooks found twice
    errors: list[str] = field(default_factory=list)   # grading's own failures
    student_notes: dict[str, list[str]] = field(default_factory=dict)   # the same, per student, for feedback
    scored: dict[str, set[str]] = field(default_factory=dict)   # Gradescope: the exercises each student is scored on


def check_report_folder(out: Path) -> None:
    """Refuse ``out`` when it is a file, or holds report files that ``grade`` did not write."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: expected a folder for the report, got '{out}' (a file)")
    if out.is_dir() and not (out / MARKER).exists():
        clash = sorted(name for name in OURS if (out / name).exists())
        if clash:
            raise ValueError(f"--out: '{out}' already holds {', '.join(clash)}, not written by `grade`; "
                             f"choose a new or empty folder (nothing was overwritten)")


def _mark(out: Path, state: str, files: list[str] | None = None) -> None:
    """The marker: who wrote the folder and how far; once whole, the files it wrote in its folders."""
    with atomic_file(out / MARKER) as handle:
        handle.write(json.dumps({"written_by": "python -m course_lib grade", "state": state, "pid": os.getpid(),
                                 "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                 **({"files": files} if files is not None else {})}) + "\n")


_FOLDERS = ("feedback", "gradescope")   # the report's folders, replaced whole by the next run


def _in_folders(root: Path) -> list[str]:
    return sorted(f"{folder}/{path.name}" for folder in _FOLDERS if (root / folder).is_dir()
                  for path in (root / folder).iterdir())


def _check_own_folders(out: Path) -> None:
    """Refuse a report folder whose feedback/ (or gradescope/) holds files the last run did not write (notes
    an instructor added): the next run replaces those folders whole, and the files would be lost."""
    try:
        written = json.loads((out / MARKER).read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, AttributeError):
        return
    if not isinstance(written, list):   # a run that did not finish, or an older version's: nothing to compare
        return
    added = sorted(set(_in_folders(out)) - set(written))
    if added:
        raise ValueError(f"--out: {out} holds files that `grade` did not write ({', '.join(added[:5])}"
                         f"{', ...' if len(added) > 5 else ''}); this run would replace their folder: move them "
                         f"out of the report folder first (nothing was overwritten)")


LOCK = ".course-grade-lock"   # held (flock) by the run writing the folder; names its pid; the OS drops it at exit


def hold_report_folder(out: Path) -> int | None:
    """Hold ``out`` for this run, or refuse naming the run that holds it: two runs writing one report folder
    would leave one's files beside the other's. The descriptor to give :func:`release_report_folder` (None
    where the OS has no flock)."""
    check_report_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        fd, _ = hold_lock(out / LOCK)
    except LockHeld as held:
        raise RuntimeError(f"out: {out} is being written by another grade run ({held.holder}); wait for it to "
                           f"end, or choose another --out") from None
    return fd


def release_report_folder(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)   # closing the descriptor drops the flock (the file stays: removing it would race a waiting run)


def claim_report_folder(out: Path) -> None:
    """Check ``out`` (see :func:`check_report_folder`) and mark it as the grader's now, before any student
    code runs: a file a submission managed to put there cannot make the final report refused."""
    check_report_folder(out)
    _check_own_folders(out)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out, STAGING)   # what a killed run left hidden: its staging, the report it replaced
    _mark(out, "grading")


def report_state(out: Path) -> tuple[str, int | None]:
    """How the last run on ``out`` left it, by its marker: ("grading" | "replacing" | "whole" | "none", its pid)."""
    try:
        marker = json.loads((out / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "none", None
    if not isinstance(marker, dict):
        return "none", None
    pid = marker.get("pid")
    return str(marker.get("state", "whole")), pid if isinstance(pid, int) else None


def _grouped(grades: list[Grade], by: str, order: Callable[[Grade], Any]) -> dict[str, list[Grade]]:
    """The grades by their ``by`` field (student or exercise), each group in ``order``."""
    groups: dict[str, list[Grade]] = {}
    for grade in sorted(grades, key=order):
        groups.setdefault(getattr(grade, by), []).append(grade)
    return groups


def _by_student(grades: list[Grade]) -> dict[str, list[Grade]]:
    return _grouped(grades, "student", lambda g: (g.student.casefold(), g.student, exercise_order(g.exercise)))


def _by_exercise(grades: list[Grade]) -> dict[str, list[Grade]]:
    return _grouped(grades, "exercise", lambda g: (exercise_order(g.exercise), g.student.casefold()))


def _mistakes(grades: list[Grade]) -> list[tuple[str, int]]:
    """Diagnosis counts, most common first (ties in the order of DIAGNOSES)."""
    counts = Counter(g.diagnosis for g in grades if not g.passed)
    rank = {code: i for i, code in enumerate(DIAGNOSES)}
    return sorted(counts.items(), key=lambda kv: (-kv[1], rank.get(kv[0], len(rank))))


NOT_MISTAKES = ("not_implemented", "missing", "checker_error")   # nothing the room got wrong


def _most_common_mistake(mistakes: list[tuple[str, int]]) -> tuple[str, int]:
    """The most common real mistake (not "not written yet" or "not handed in"), else the most common."""
    real = [(code, n) for code, n in mistakes if code not in NOT_MISTAKES]
    return (real or mistakes)[0]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_SPLIT_FORMULA = re.compile(r"([;,|\t])([=+\-@])")


def spreadsheet_safe(text: str) -> str:
    """A cell a spreadsheet shows as text: one starting like a formula (``= + - @``, a tab or a carriage
    return) gets a leading apostrophe, so that ``=HYPERLINK(...)`` in a student's name or message
    is never run when the instructor opens grades.csv (OWASP's advice on CSV injection)."""
    text = re.sub(r"[\r\n]+", " ", text)   # one line per row: a reader that ignores quoting starts a row there
    text = _SPLIT_FORMULA.sub(r"\1 \2", text)   # a spreadsheet that splits on ";" (or "|", a tab) starts a cell there
    return "'" + text if text.startswith(_FORMULA_START) else text


def grades_csv(grades: list[Grade]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(COLUMNS)
    for student_grades in _by_student(grades).values():
        for g in student_grades:
            writer.writerow([spreadsheet_safe(g.student), g.exercise, "true" if g.passed else "false",
                             spreadsheet_safe(g.diagnosis or ""), spreadsheet_safe(g.message), f"{g.seconds:.3f}", spreadsheet_safe(g.flag)])
    return buffer.getvalue()


def summary_markdown(grades: list[Grade], info: RunInfo) -> str:
    exercises = _by_exercise(grades)
    students = _by_student(grades)
    lines = ["# The class's grades", "",
             f"{info.students} student(s), {len(exercises)} exercise(s) "
             f"({', '.join(exercises)}); graded {time.strftime('%Y-%m-%d %H:%M')} in {info.seconds:.0f} s with "
             f"{info.workers} worker(s), {info.timeout:g} s per notebook, "
             + (f"{info.memory_mb} MB per exercise" if info.memory_mb else "no memory limit")
             + f"; {info.sandbox}.", "",
             "| exercise | passed | mistakes (students) |", "|---|---|---|"]
    sections: list[str] = []   # one per exercise, after the table
    for ex_id, ex_grades in exercises.items():
        passed = sum(g.passed for g in ex_grades)
        mistakes = _mistakes(ex_grades)
        counts = ", ".join(f"{code} {n}" for code, n in mistakes)
        lines.append(f"| {ex_id} {_cell(exercise_title(ex_id))} | {passed}/{len(ex_grades)} | {counts or '-'} |")
        sections += ["", f"## {ex_id}: {passed}/{len(ex_grades)} passed{'; ' + counts if counts else ''}", "",
                     f"*{exercise_title(ex_id)}*"]
        if not mistakes:
            continue
        sections += ["", "| diagnosis | students | who |", "|---|---|---|"]
        for code, count in mistakes:
            who = ", ".join(g.student for g in ex_grades if g.diagnosis == code)
            sections.append(f"| {code} | {count} | {markdown_inline(who)} |")
        top, count = _most_common_mistake(mistakes)
        said = [g.message for g in ex_grades if g.diagnosis == top]
        sections += ["", f"**Tell the room** ({top}, {count} student(s)): "
                         f"{markdown_inline(room_hint(ex_id, top, said))}"]
    lines += sections
    lines += ["", "## Students", "", "| student | passed | not yet |", "|---|---|---|"]
    for student, student_grades in students.items():
        failing = ", ".join(f"{g.exercise} ({g.diagnosis})" for g in student_grades if not g.passed) or "-"
        lines.append(f"| {markdown_inline(student)} | {sum(g.passed for g in student_grades)}/{len(student_grades)} | "
                     f"{_cell(failing)} |")
    flagged = [g for g in grades if g.flag]
    if flagged:   # a flag, not a fail: copying a solution the course shows is a teaching matter
        lines += ["", "## Flagged for the instructor", "", "Graded as usual; worth a conversation.", "",
                  "| student | exercise | flag |", "|---|---|---|"]
        lines += [f"| {markdown_inline(g.student)} | {g.exercise} | {markdown_inline(g.flag)} |"
                  for g in sorted(flagged, key=lambda g: (g.student.casefold(), exercise_order(g.exercise)))]
    if info.notes or info.errors:
        said = [markdown_inline(note) for note in info.notes] + \
            [f"grading error: {markdown_inline(error)}" for error in info.errors]
        lines += ["", "## Notes", ""] + [f"- {line}" for line in cap_lines(said, SUMMARY_NOTES_LIMIT, "notes")]
    return "\n".join(lines) + "\n"


def feedback_markdown(student: str, grades: list[Grade], notes: list[str] | tuple[str, ...] = ()) -> str:
    """One student's verdicts, messages and hints (never the solution), and notes on their files
    (which file was graded where several could be the same notebook, what was skipped)."""
    passed = sum(g.passed for g in grades)
    lines = [f"# Feedback for {markdown_inline(student)}", "", f"{passed} of {len(grades)} exercises passed.", ""]
    lines += [f"- {markdown_inline(note)}" for note in notes] + ([""] if notes else [])
    lines += ["| exercise | verdict |", "|---|---|"]
    sections: list[str] = []   # one per exercise, after the table
    for g in grades:
        verdict = "passed" if g.passed else f"not yet ({g.diagnosis})"
        lines.append(f"| {g.exercise} {_cell(exercise_title(g.exercise))} | {verdict} |")
        sections += ["", f"## {g.exercise} {exercise_title(g.exercise)}: {verdict}", "", markdown_block(g.message)]
        hint = first_hint(g.exercise)
        if not g.passed and hint and g.diagnosis not in ("missing", "crashed", "checker_error"):
            sections += ["", f"Hint: {hint} (more with `checks.hint(\"{g.exercise}\")` in the notebook)"]
    lines += sections
    return "\n".join(lines) + "\n"


# Okabe and Ito's palette (2008), told apart with every kind of colour vision; passed is its bluish
# green, the not-yet-done grey. Beyond its seven colours, the colours come round again with a hatch,
# and past the hatches, with two different hatches drawn over each other (7 x 56 diagnoses in all).
OKABE_ITO = ("#E69F00", "#56B4E9", "#D55E00", "#0072B2", "#CC79A7", "#F0E442", "#000000")
HATCHES = ("", "///", "...", "xxx", "\\\\\\", "++", "oo", "--", "||", "**", "OO")
FIXED_STYLES = {"passed": ("#009E73", ""), "not_implemented": ("#DDDDDD", ""), "missing": ("#999999", "")}


def _hatches():
    """Every single hatch, then every pair of two different ones drawn over each other: all distinct."""
    yield from HATCHES
    for i, first in enumerate(HATCHES[1:], 1):
        for second in HATCHES[i + 1:]:
            yield first + second


def figure_styles(codes: list[str]) -> dict[str, tuple[str, str]]:
    """The (colour, hatch) of "passed" and of each diagnosis in ``codes``: no two alike."""
    styles = dict(FIXED_STYLES)
    others = [code for code in codes if code not in styles]
    hatches = _hatches()
    for i, code in enumerate(others):
        if i % len(OKABE_ITO) == 0:
            hatch = next(hatches)   # each round of the seven colours gets a hatch of its own
        styles[code] = (OKABE_ITO[i % len(OKABE_ITO)], hatch)
    return styles


def summary_figure(grades: list[Grade]) -> bytes:
    """A PNG: one horizontal bar per exercise, passed and each diagnosis stacked."""
    from matplotlib.figure import Figure
    exercises = _by_exercise(grades)
    seen = {g.diagnosis for g in grades if not g.passed and g.diagnosis}
    # the table's order, then any diagnosis the table lacks, so that every grade is drawn
    codes = [code for code in DIAGNOSES if code in seen] + sorted(seen - set(DIAGNOSES))
    names = list(exercises)[::-1]   # first exercise at the top
    fig = Figure(figsize=(9, 1.2 + 0.32 * len(names)))
    ax = fig.add_subplot()
    left = [0] * len(names)
    styles = figure_styles(codes)
    for label in ["passed", *codes]:
        counts = [sum((g.passed if label == "passed" else g.diagnosis == label) for g in exercises[ex])
                  for ex in names]
        if any(counts):
            colour, hatch = styles[label]
            ax.barh(names, counts, left=left, color=colour, hatch=hatch, label=label, edgecolor="white",
                    linewidth=0.5)
            left = [a + b for a, b in zip(left, counts)]
        if label == "passed":
            for y, count in enumerate(counts):
                if count:
                    ax.text(count - 0.1, y, str(count), va="center", ha="right", color="white", fontsize=8)
    ax.set_xlabel("students")
    students = len({g.student for g in grades})
    ax.set_title(f"{students} student(s): passed, and each kind of mistake")
    ax.set_xlim(0, max(students, 1))
    if ax.get_legend_handles_labels()[0]:   # no bars (no grades yet): no legend to draw
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()


def _pause_at(point: str) -> None:
    """The test hook (:data:`PAUSE_VARIABLE`): at ``point``, say so in a file and wait to be killed."""
    wanted = os.environ.get(PAUSE_VARIABLE, "")
    if ":" not in wanted or wanted.split(":", 1)[0] != point:
        return
    flag = Path(wanted.split(":", 1)[1])
    flag.write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while flag.exists() and time.monotonic() < deadline:   # until the test removes it (or kills us)
        time.sleep(0.05)


def _write(path: Path, data: str | bytes, written: set[Path]) -> None:
    """Write a file of the staging folder (private to this run: no other writer, no reader yet)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data if isinstance(data, bytes) else data.encode("utf-8"))
        handle.flush()
        os.fsync(handle.fileno())
    written.add(path)
    _pause_at(path.name)


@contextlib.contextmanager
def _signals_held() -> Any:
    """Ctrl-C and SIGTERM wait until the block is done, then take effect as they would have. Python runs
    handlers in the main thread whichever thread the system gave the signal to, so the handlers are
    swapped (masking the main thread alone would not hold a signal delivered to another thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {number: signal.signal(number, lambda n, frame: caught.append(n))
                for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, signal.SIG_DFL if handler is None else handler)
        if caught:
            signal.raise_signal(caught[0])


def _stubs(folder: Path, names: set[str]) -> None:
    """Write into ``folder`` the stub of each report file in ``names`` that a reader opens: each says, on
    its first line, that the report is incomplete (a CSV or JSON reader fails on it rather than reading
    an empty class). The figure has no stub: it is simply absent meanwhile."""
    why = (f"{INCOMPLETE}: a `python -m course_lib grade` run (pid {os.getpid()}) was replacing the report "
           f"in this folder and stopped before it finished. Run the same grade command again.")
    # grades.csv: a table of one column, named by its first line, and one row, so that a reader of the grades'
    # columns fails (KeyError: 'student') rather than read an empty class
    texts = {"summary.md": f"# {why}\n", "grades.csv": f"\"# {why}\"\nrun the same grade command again\n",
             "results.json": json.dumps({"report_incomplete": why}) + "\n"}
    for name in names & set(texts):
        (folder / name).write_text(texts[name], encoding="utf-8")
    for name in names & {"feedback", "gradescope"}:
        (folder / name).mkdir()
        (folder / name / "REPORT-INCOMPLETE.md").write_text(f"# {why}\n", encoding="utf-8")


def _swap_in(out: Path, staging: Path) -> None:
    """Replace the report in ``out`` by what ``staging`` holds: each old file out and, where the new report
    has that file, its stub in (``summary.md`` first); then the new files over the stubs, ``summary.md``
    last (see the module docstring)."""
    files = _in_folders(staging)
    old = Path(tempfile.mkdtemp(prefix=staging_prefix(STAGING), suffix=".tmp", dir=out))
    try:   # the stubs first: a disk that is full here leaves the previous report, and its marker, as they were
        stubs = old / ".stubs"
        stubs.mkdir()
        _stubs(stubs, {name for name in OURS if os.path.lexists(staging / name)})
        _mark(out, "replacing")
    except BaseException:
        shutil.rmtree(old, ignore_errors=True)
        raise
    with _signals_held():
        for name in reversed(SWAP_ORDER):
            if os.path.lexists(out / name):
                os.replace(out / name, old / name)
            if os.path.lexists(stubs / name):
                os.replace(stubs / name, out / name)
        _pause_at("swapping")
        for name in SWAP_ORDER:
            if not os.path.lexists(staging / name):
                continue
            if os.path.isdir(staging / name) and os.path.lexists(out / name):
                os.replace(out / name, stubs / name)   # a folder cannot be renamed over a full one
            os.replace(staging / name, out / name)
            _pause_at(f"in:{name}")
        _mark(out, "whole", files)
        # still holding the signals: a Ctrl-C held through the swap is raised as the block ends, and would
        # leave the previous report's files hidden in the folder until the next run
        shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)


def write_report(out: Path, grades: list[Grade], info: RunInfo, *, gradescope: bool = False) -> list[Path]:
    """Write the report into ``out`` (see the module docstring); the paths written."""
    check_report_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out, STAGING)
    staging = Path(tempfile.mkdtemp(prefix=staging_prefix(STAGING), suffix=".tmp", dir=out))
    try:
        written = _write_all(staging, grades, info, gradescope)
        _pause_at("staged")
        _swap_in(out, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)   # the previous report stays as it was
        raise
    return sorted(out / path.relative_to(staging) for path in written)


def _write_all(staging: Path, grades: list[Grade], info: RunInfo, gradescope: bool) -> set[Path]:
    written: set[Path] = set()

    def attempt(path: Path, make: Callable[..., str | bytes], *args: Any, whose: str = "") -> None:
        try:
            _write(path, make(*args), written)
        except Exception as exc:  # one file's failure (a disk, a student's text) never costs the others
            info.errors.append(f"{path.name}{' for ' + whose if whose else ''} could not be written "
                               f"({type(exc).__name__}: {exc})")

    students = _by_student(grades)
    used: set[str] = set()
    (staging / "feedback").mkdir()
    for student, student_grades in students.items():   # first: a failure here is named in summary.md
        name = safe_file_name(student)
        while name.casefold() in used:   # two students whose names differ only in odd characters
            name += "_"
        used.add(name.casefold())
        attempt(staging / "feedback" / f"{name}.md", feedback_markdown, student, student_grades,
                info.student_notes.get(student, ()), whose=student)
        if gradescope:
            scored = info.scored.get(student)
            result = results_json([g for g in student_grades if not scored or g.exercise in scored])
            attempt(staging / "results.json" if len(students) == 1 else staging / "gradescope" / name / "results.json",
                    lambda data: json.dumps(data, indent=2) + "\n", result, whose=student)
    _pause_at("feedback")
    attempt(staging / "grades.csv", grades_csv, grades)
    attempt(staging / "summary.png", summary_figure, grades)
    attempt(staging / "summary.md", summary_markdown, grades, info)
    return written

"""The nbgrader workflow for real, with nbgrader's default settings (no nbgrader_config.py).

nbgrader comes with the instructor extra (`pip install -c constraints.txt -e ".[test,instructor]"`,
which `make test` installs); without it these tests fail, never skip. One course directory in
nbgrader's default layout is built for the module: notebook 01 (no corpus, about 3 s to run) is
released with `generate_assignment`, four submissions are autograded in one `autograde` run and
`generate_feedback` writes their feedback. About 30 s in all on a quiet 2-core machine.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib.classroom.assignments import make_learner_copy

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
NOTEBOOK = "01_attention_toy.ipynb"
ASSIGNMENT = "ps1"
CHECKS = ["ex1_1_check", "ex1_2_check", "ex1_3_check"]
# The mistake: exercise 1.3 without the 1/sqrt(d) scale; its checker's diagnosis is "scale".
MISTAKE = ("ex1_3_solution", "scores = q @ k.transpose(-2, -1) / d ** 0.5", "scores = q @ k.transpose(-2, -1)")
STUDENTS = ("solved", "released", "learner", "mistake")


def _require_nbgrader() -> None:
    try:
        import nbgrader  # noqa: F401
    except ImportError:
        pytest.fail("nbgrader is not installed: these tests run the real nbgrader. Install the instructor extra: "
                    "pip install -c constraints.txt -e \".[test,instructor]\" (make test does)")


def _env(root: Path) -> dict[str, str]:
    """This checkout's course_lib, this venv first on PATH (nbgrader runs `alembic` from there), no user config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBGRADER")}
    env.update(PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               JUPYTER_CONFIG_DIR=str(root / ".jupyter-config"), JUPYTER_DATA_DIR=str(root / ".jupyter-data"),
               MPLBACKEND="Agg", COURSE_STATIC_WIDGETS="1", COURSE_THREADS="2")
    return env


def _nbgrader(root: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=root, env=_env(root),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def _read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _grade_id(cell: dict) -> str | None:
    return cell["metadata"].get("nbgrader", {}).get("grade_id")


def _submit(root: Path, student: str, notebook: dict) -> None:
    folder = root / "submitted" / student / ASSIGNMENT
    folder.mkdir(parents=True)
    (folder / NOTEBOOK).write_text(json.dumps(notebook, indent=1, ensure_ascii=False), encoding="utf-8")


def _solved(released: dict, source: dict, mistake: tuple[str, str, str] | None = None) -> dict:
    """The released notebook with each answer cell written as the solution (with one mistake, if given)."""
    answers = {_grade_id(c): "".join(c["source"]) for c in source["cells"]
               if c["metadata"].get("nbgrader", {}).get("solution")}
    notebook = copy.deepcopy(released)
    for cell in notebook["cells"]:
        answer = answers.get(_grade_id(cell))
        if answer is None:
            continue
        if mistake and _grade_id(cell) == mistake[0]:
            assert mistake[1] in answer, "the solution of exercise 1.3 changed: update MISTAKE"
            answer = answer.replace(mistake[1], mistake[2])
        cell["source"] = answer
    return notebook


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """generate_assignment, four submissions, autograde and generate_feedback, once for the module."""
    _require_nbgrader()
    root = tmp_path_factory.mktemp("nbgrader-course")
    source_dir = root / "source" / ASSIGNMENT
    source_dir.mkdir(parents=True)
    (source_dir / NOTEBOOK).write_bytes((ROOT / "notebooks" / NOTEBOOK).read_bytes())
    logs = {"generate": _nbgrader(root, "generate_assignment", ASSIGNMENT)}

    source, released = _read(source_dir / NOTEBOOK), _read(root / "release" / ASSIGNMENT / NOTEBOOK)
    make_learner_copy(source_dir / NOTEBOOK, root / "learner" / NOTEBOOK)   # `course_lib start`'s copy
    _submit(root, "solved", _solved(released, source))
    _submit(root, "released", released)                                    # nbgrader's learner copy
    _submit(root, "learner", _read(root / "learner" / NOTEBOOK))
    _submit(root, "mistake", _solved(released, source, MISTAKE))
    logs["autograde"] = _nbgrader(root, "autograde", ASSIGNMENT)
    logs["feedback"] = _nbgrader(root, "generate_feedback", ASSIGNMENT)
    return {"root": root, "source": source, "released": released, "logs": logs}


def _gradebook(root: Path) -> dict[str, dict]:
    """Each student's score, maximum, per-test scores and whether nbgrader asks for manual grading."""
    from nbgrader.api import Gradebook
    saved = os.environ["PATH"]
    os.environ["PATH"] = _env(root)["PATH"]   # Gradebook runs `alembic` too
    try:
        with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gradebook:
            found = {}
            for student in STUDENTS:
                submission = gradebook.find_submission(ASSIGNMENT, student)
                found[student] = {"score": submission.score, "max": submission.max_score,
                                  "manual": submission.needs_manual_grade,
                                  "tests": {g.name: g.auto_score for g in submission.notebooks[0].grades}}
            return found
    finally:
        os.environ["PATH"] = saved


def _autograded(root: Path, student: str) -> dict:
    return _read(root / "autograded" / student / ASSIGNMENT / NOTEBOOK)


def _feedback(root: Path, student: str) -> str:
    return (root / "feedback" / student / ASSIGNMENT / NOTEBOOK.replace(".ipynb", ".html")).read_text(encoding="utf-8")


# ---------------------------------------------------------------- generate_assignment

def test_the_release_has_nbgraders_stubs_and_read_only_tests(course):
    cells = {_grade_id(c): c for c in course["released"]["cells"] if _grade_id(c)}
    assert sorted(cells) == sorted(CHECKS + ["ex1_1_solution", "ex1_2_solution", "ex1_3_solution"])
    assert "BEGIN SOLUTION" not in json.dumps(course["released"])
    assert "/ d ** 0.5" not in "".join(cells["ex1_3_solution"]["source"])
    for grade_id in CHECKS:
        assert cells[grade_id]["metadata"]["editable"] is False and cells[grade_id]["metadata"]["deletable"] is False
        assert "checks.check_" in "".join(cells[grade_id]["source"])
    assert "raise NotImplementedError()" in "".join(cells["ex1_2_solution"]["source"])


def test_every_notebook_passes_nbgraders_release_steps_with_default_settings():
    """What generate_assignment does to a notebook, in process for all of them (notebook 01 runs for real above)."""
    _require_nbgrader()
    import nbformat
    from nbgrader.nbgraderformat import MetadataValidator
    from nbgrader.preprocessors import CheckCellMetadata, ClearSolutions, ComputeChecksums, LockCells

    points = {}
    for path in NOTEBOOKS:
        notebook = nbformat.read(path, as_version=4)
        MetadataValidator().validate_nb(notebook)
        resources: dict = {}
        for step in (LockCells(), ClearSolutions(), CheckCellMetadata(), ComputeChecksums()):
            notebook, resources = step.preprocess(notebook, resources)
        assert not any("BEGIN SOLUTION" in cell.source for cell in notebook.cells), path.name
        points[path.name[:2]] = sum(c.metadata.nbgrader["points"] for c in notebook.cells
                                    if c.metadata.get("nbgrader", {}).get("grade"))
    assert points["08"] == 0   # the capstone is not graded by nbgrader
    assert all(points[key] > 0 for key in points if key != "08"), points


# ---------------------------------------------------------------- autograde

def test_a_solved_submission_gets_full_marks(course):
    grades = _gradebook(course["root"])["solved"]
    assert grades["max"] == len(CHECKS) and grades["score"] == grades["max"], grades
    assert not grades["manual"]


def test_a_solved_submission_runs_without_one_error(course):
    """The demonstration of a planted bug (graded=False) shows its red box and raises nothing."""
    cells = _autograded(course["root"], "solved")["cells"]
    errors = [c["source"] for c in cells if c["cell_type"] == "code"
              for o in c["outputs"] if o["output_type"] == "error"]
    assert errors == []
    demo = next(c for c in cells if "graded=False" in "".join(c["source"]))
    assert "NOT YET (softmax_dim)" in json.dumps(demo["outputs"])


@pytest.mark.parametrize("student", ["released", "learner"])
def test_an_untouched_learner_copy_gets_zero(course, student):
    grades = _gradebook(course["root"])[student]
    assert grades["max"] == len(CHECKS) and grades["score"] == 0, grades
    assert grades["tests"] == dict.fromkeys(CHECKS, 0) and not grades["manual"]


def test_a_mistake_loses_its_exercises_point(course):
    grades = _gradebook(course["root"])["mistake"]
    assert grades["tests"] == {"ex1_1_check": 1, "ex1_2_check": 1, "ex1_3_check": 0}, grades
    assert grades["score"] == len(CHECKS) - 1


def test_autograde_reads_no_check_as_a_partial_credit_score(course):
    assert "cannot be converted to" not in course["logs"]["autograde"]


# ---------------------------------------------------------------- feedback

def test_the_feedback_shows_the_diagnosis_of_the_mistake(course):
    html = _feedback(course["root"], "mistake")
    assert "Exercise 1.3: NOT YET (scale). Your scores are not scaled" in html


def test_the_feedback_names_each_unwritten_exercise(course):
    html = _feedback(course["root"], "learner")
    for label in ("NOT YET (not_implemented)",
                  "Exercise 1.2: scores, softmax over the keys, weighted sum of the values",
                  "Exercise 1.3: scaled scores, -inf where the mask is False"):
        assert label in html, label

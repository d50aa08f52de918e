"""nbgrader cell metadata: every course notebook carries exactly what the script writes, the rules that
decide it, the notebooks it refuses, and that writing it changes cell metadata and nothing else."""
from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest
from nbformat import v4

from course_lib.classroom import nbgrader_metadata
from course_lib.classroom.assignments import make_learner_copy
from course_lib.classroom.nbgrader_metadata import apply, differences, expected_metadata, main

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))

SOLUTION_21 = '''def causal_mask(n):
    ### BEGIN SOLUTION (Exercise 2.1: True on and below the diagonal)
    return torch.ones(n, n, dtype=torch.bool).tril()
    ### END SOLUTION
'''
SOLUTION_22 = '''class MaskedAttention(nn.Module):
    def forward(self, x):
        ### BEGIN SOLUTION (Exercise 2.2: write MaskedAttention.forward)
        return x
        ### END SOLUTION
'''


def _notebook(*cells) -> dict:
    built = []
    for cell in cells:
        if isinstance(cell, str) and cell.startswith("md:"):
            built.append(v4.new_markdown_cell(cell[3:]))
        elif isinstance(cell, str):
            built.append(v4.new_code_cell(cell))
        else:
            built.append(cell)
    return json.loads(nbformat.writes(v4.new_notebook(cells=built)))


def _ids(metadata):
    return [None if m is None else m["grade_id"] for m in metadata]


# ---------------------------------------------------------------- the course's notebooks

def test_the_course_has_notebooks_to_check():
    assert len(NOTEBOOKS) >= 8


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_notebook_carries_the_metadata_the_script_writes(path):
    problems = differences(path)
    assert not problems, ("\n".join(problems) + "\nrun: python -m course_lib.classroom.nbgrader_metadata notebooks")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_exercise_with_a_solution_is_worth_points(path):
    notebook = json.loads(path.read_text(encoding="utf-8"))
    metadata = [m for m in expected_metadata(notebook, path.name) if m]
    solutions = {m["grade_id"].removesuffix("_solution") for m in metadata if m["solution"]}
    tested = {m["grade_id"].split("_check")[0] for m in metadata if m["grade"]}
    assert solutions == tested
    if path.name.startswith("08_"):
        assert metadata == []   # the capstone: 8.1 needs the parts of other notebooks, nbgrader grades none


def test_the_learner_copy_keeps_the_metadata_so_nbgrader_can_grade_it(tmp_path):
    source = NOTEBOOKS[0]
    make_learner_copy(source, tmp_path / source.name)
    before = json.loads(source.read_text(encoding="utf-8"))["cells"]
    after = json.loads((tmp_path / source.name).read_text(encoding="utf-8"))["cells"]
    assert [c["metadata"].get("nbgrader") for c in after] == [c["metadata"].get("nbgrader") for c in before]
    assert any(c["metadata"].get("nbgrader") for c in after)


# ---------------------------------------------------------------- the rules

def test_solution_and_check_cells_get_their_metadata():
    notebook = _notebook("md:# Masks", "import torch", SOLUTION_21, "checks.check_causal_mask(causal_mask)",
                         SOLUTION_22, "checks.check_masked_attention(MaskedAttention)",
                         "result = checks.check_masked_attention(MaskedAttention, num_heads=1)\nresult")
    metadata = expected_metadata(notebook)
    assert _ids(metadata) == [None, None, "ex2_1_solution", "ex2_1_check", "ex2_2_solution", "ex2_2_check",
                              "ex2_2_check_2"]
    assert metadata[2] == {"grade": False, "grade_id": "ex2_1_solution", "locked": False, "schema_version": 3,
                           "solution": True, "task": False}
    assert metadata[3] == {"grade": True, "grade_id": "ex2_1_check", "locked": True, "points": 1,
                           "schema_version": 3, "solution": False, "task": False}


def test_demonstrations_re_checks_and_the_capstone_are_not_tests():
    notebook = _notebook(SOLUTION_21, "checks.check_causal_mask(causal_mask)",
                         "checks.check_causal_mask(buggy_mask, graded=False)",
                         "mask = causal_mask if checks.check_causal_mask(causal_mask, graded=False) else reference",
                         "checks.check_trains_like_reference(yours, reference)",
                         "%time checks.check_causal_mask(buggy_mask, graded=False)")
    assert _ids(expected_metadata(notebook)) == ["ex2_1_solution", "ex2_1_check", None, None, None, None]


def test_a_check_inside_a_magic_is_still_read():
    notebook = _notebook(SOLUTION_21, "%%time\nchecks.check_causal_mask(causal_mask)",
                         "%time checks.check_causal_mask(causal_mask)", "%%bash\necho checks.check_x(")
    assert _ids(expected_metadata(notebook)) == ["ex2_1_solution", "ex2_1_check", "ex2_1_check_2", None]


@pytest.mark.parametrize("cells, problem", [
    ((SOLUTION_21.replace(" (Exercise 2.1: True on and below the diagonal)", ""),
      "checks.check_causal_mask(causal_mask)"), "must name its exercise"),
    ((SOLUTION_21 + "checks.check_causal_mask(causal_mask)\n",), "separate cells"),
    ((SOLUTION_21, SOLUTION_22, "checks.check_causal_mask(causal_mask)\n"
      "checks.check_masked_attention(MaskedAttention)"), "give each its own cell"),
    ((SOLUTION_21, "checks.check_causal_mask(causal_mask)", "checks.check_split_heads(split_heads)"),
     "pass graded=False"),
    ((SOLUTION_21, "checks.check_causal_mask(causal_mask, graded=False)"), "no graded check cell"),
    ((SOLUTION_21, "checks.check_causal_mask(causal_mask, graded=flag)"), "literal True or False"),
    ((SOLUTION_21, "checks.check_causal_mask(causal_mask)", "checks.check_causal_mak(causal_mask)"),
     "not one of the course's checkers"),
    ((SOLUTION_21, "checks.check_causal_mask(causal_mask)", "md:Write it between `### BEGIN SOLUTION` and "
      "`### END SOLUTION`."), "nbgrader reads"),
    ((SOLUTION_21, "checks.check_causal_mask(causal_mask)", 'print("END SOLUTION")'), "nbgrader reads"),
])
def test_notebooks_nbgrader_could_not_grade_are_refused(cells, problem):
    with pytest.raises(ValueError, match=problem):
        expected_metadata(_notebook(*cells), "09_new.ipynb")


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="notebook: expected a notebook's JSON"):
        expected_metadata({"cells": "none"})
    with pytest.raises(TypeError, match="name: expected a str"):
        expected_metadata(_notebook(), name=9)
    with pytest.raises(FileNotFoundError, match="notebook_path: expected an existing .ipynb file"):
        apply("/nonexistent/notebook.ipynb")


# ---------------------------------------------------------------- writing it

def _write(path: Path, notebook: dict) -> Path:
    path.write_text(nbformat.writes(nbformat.from_dict(notebook)) + "\n", encoding="utf-8")
    return path


def test_apply_changes_cell_metadata_and_nothing_else(tmp_path):
    stale = v4.new_code_cell("x = 1", metadata={"nbgrader": {"grade": True, "grade_id": "old", "locked": False,
                                                             "points": 3, "schema_version": 3, "solution": False},
                                                "tags": ["keep-me"]})
    check = v4.new_code_cell("checks.check_causal_mask(causal_mask)", execution_count=2, outputs=[
        v4.new_output("execute_result", data={"text/plain": "Exercise 2.1: PASSED. ✔"}, execution_count=2)])
    path = _write(tmp_path / "02_masks.ipynb", _notebook("md:# Masks — ünïcode", SOLUTION_21, check, stale))
    before = json.loads(path.read_text(encoding="utf-8"))

    assert differences(path)
    assert apply(path) == 3   # the solution, the check, and the stale entry removed
    after = json.loads(path.read_text(encoding="utf-8"))
    assert differences(path) == []
    for old, new in zip(before["cells"], after["cells"]):
        old_meta = {k: v for k, v in old["metadata"].items() if k != "nbgrader"}
        new_meta = {k: v for k, v in new["metadata"].items() if k != "nbgrader"}
        assert old_meta == new_meta and {k: v for k, v in old.items() if k != "metadata"} == \
            {k: v for k, v in new.items() if k != "metadata"}
    assert "nbgrader" not in after["cells"][3]["metadata"]
    assert after["metadata"] == before["metadata"]
    text = path.read_text(encoding="utf-8")
    assert text == json.dumps(after, sort_keys=True, indent=1, ensure_ascii=False) + "\n"   # nbformat's layout
    assert "ünïcode" in text and "✔" in text

    assert apply(path) == 0   # idempotent: the second run leaves the file byte for byte
    assert path.read_text(encoding="utf-8") == text


def test_a_refused_notebook_is_left_untouched(tmp_path):
    path = _write(tmp_path / "09_new.ipynb", _notebook(SOLUTION_21))
    text = path.read_text(encoding="utf-8")
    with pytest.raises(ValueError, match="no graded check cell"):
        apply(path)
    assert path.read_text(encoding="utf-8") == text


def test_the_command_checks_and_writes(tmp_path, capsys):
    path = _write(tmp_path / "02_masks.ipynb", _notebook(SOLUTION_21, "checks.check_causal_mask(causal_mask)"))
    assert main(["--check", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert "02_masks.ipynb, cell 1: nbgrader metadata is none, expected" in out
    assert "python -m course_lib.classroom.nbgrader_metadata" in err

    assert main([str(tmp_path)]) == 0
    assert "updated 2 cell(s)" in capsys.readouterr().out
    assert main(["--check", str(path)]) == 0
    assert main([str(path)]) == 0 and "up to date" in capsys.readouterr().out

    _write(tmp_path / "09_new.ipynb", _notebook(SOLUTION_21))
    assert main(["--check", str(tmp_path)]) == 2
    assert "error: 09_new.ipynb, cell 1" in capsys.readouterr().err
    assert main([str(tmp_path / "missing")]) == 2


def test_the_module_says_what_it_writes():
    assert nbgrader_metadata.SCHEMA_VERSION == 3 and nbgrader_metadata.POINTS_PER_CHECK == 1

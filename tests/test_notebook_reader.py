"""The one reader of student code: what a definition needs, and that collection (notebook 08) and
grading take exactly the same source from the same notebook."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import nbformat
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
KNOWN = {"torch", "nn", "F", "math", "split_heads", "checks"}


@pytest.fixture
def reader():
    # imported here, not at the top, so that the last test also runs against a course_lib without
    # this module (see its docstring)
    from course_lib.classroom import notebook_reader
    return notebook_reader


def _cells(*sources: str, ids: tuple[str, ...] = ()) -> list:
    cells = [nbformat.v4.new_code_cell(source) for source in sources]
    for cell, cell_id in zip(cells, ids):
        cell.id = cell_id
    return cells


def _run(source: str, name: str):
    namespace = {"torch": torch}
    exec(compile(source, "<part>", "exec"), namespace)
    return namespace[name]


def test_a_definition_comes_with_helpers_of_helpers_constants_same_cell_helpers_and_imports(reader):
    cells = _cells(
        "import math as m2\nSCALE = 2\nprint('noise')\n\ndef inner(x):\n    return x * SCALE\n",
        "%time _ = 1\ndef outer(x):\n    return inner(x) + round(m2.pi)\n\ntrain_for_an_hour = True\n",
        "def split_heads(x):\n    raise RuntimeError('the course provides split_heads: never taken')\n",
        "from functools import reduce\nKEEP_DIAGONAL = 0\n\ndef ones(L):\n    return torch.ones(L, L)\n\n"
        "def causal_mask(L):\n    assert reduce(max, [1, 2]) == 2\n"
        "    return ones(L).tril(KEEP_DIAGONAL).bool() & (outer(1) == 5)\n\nprint(causal_mask(3))\n",
        ids=("a", "b", "c", "exercise"))
    found = reader.student_definition(cells, "causal_mask", "exercise", KNOWN)
    assert found.problem is None and found.cell == 3 and not found.moved
    for needed in ("import math as m2", "SCALE = 2", "def inner", "def outer", "from functools import reduce",
                   "KEEP_DIAGONAL = 0", "def ones", "def causal_mask"):
        assert needed in found.source, needed
    for left_out in ("print", "train_for_an_hour", "split_heads", "%time"):
        assert left_out not in found.source, left_out
    assert torch.equal(_run(found.source, "causal_mask")(3), torch.ones(3, 3).tril().bool())


def test_the_last_binding_before_use_is_taken_and_a_moved_definition_is_found(reader):
    cells = _cells("LIMIT = 1\n", "LIMIT = 3\n\ndef clip(x):\n    return min(x, LIMIT)\n",
                   "print('the exercise cell, emptied')\n", "LIMIT = 99\n",
                   "def causal_mask(L):\n    return torch.ones(L, L).tril() * clip(7)\n",
                   ids=("a", "b", "exercise", "c", "d"))
    found = reader.student_definition(cells, "causal_mask", "exercise", KNOWN)
    assert found.moved and found.cell == 4
    # clip reads the LIMIT bound at call time: the last one, of cell "c"
    assert _run(found.source, "causal_mask")(2).max() == 7
    assert "LIMIT = 99" in found.source and "LIMIT = 1\n" not in found.source
    missing = reader.student_definition(cells[:4], "causal_mask", "exercise", KNOWN)
    assert missing.problem == "not_defined" and missing.source is None
    broken = reader.student_definition(_cells("def causal_mask(L:\n", ids=("exercise",)), "causal_mask",
                                       "exercise", KNOWN)
    assert broken.problem == "syntax" and "line 1" in broken.detail


def test_one_marker_pattern_and_no_other_in_the_package(reader):
    begin = reader.marker("    ### BEGIN SOLUTION (Exercise 2.2: write forward)  \n")
    assert (begin.kind, begin.indent, begin.exercise) == ("begin", "    ", "2.2")
    assert reader.marker("### BEGIN SOLUTION").exercise is None   # accepted by learner copies, names nothing
    assert reader.marker("\t### END SOLUTION").kind == "end"
    for near_miss in ("## BEGIN SOLUTION", "### BEGIN SOLUTION extra", "x = 1  ### END SOLUTION",
                      "### begin solution (Exercise 2.2: x)"):
        assert reader.marker(near_miss) is None, near_miss
    assert reader.looks_like_marker("## begin solution") == "begin"
    assert reader.marked_exercises("### BEGIN SOLUTION (Exercise 3.1: a)\n### END SOLUTION\n") == ["3.1"]
    compiled = re.compile(r"re\.compile\([^\n]*(BEGIN|END)[ \\t_]+SOLUTION")
    elsewhere = [str(path.relative_to(ROOT)) for path in (ROOT / "course_lib").rglob("*.py")
                 if path.name != "notebook_reader.py" and compiled.search(path.read_text(encoding="utf-8"))]
    assert elsewhere == []


def test_the_course_exercise_cells_are_found_with_their_names(reader):
    by_id = {}
    for path in sorted((ROOT / "notebooks").glob("0[29]_*.ipynb")):
        by_id.update({cell.id: cell for cell in reader.exercise_cells(reader.read_cells(path))})
    assert by_id["2.1"].name == "causal_mask" and by_id["2.1"].alone
    assert by_id["9.2"].name == "apply_rotary" and not by_id["9.2"].alone   # rotate_half beside it
    assert "def rotate_half" in by_id["9.2"].solution


def test_collection_and_grading_take_the_same_source_and_it_runs_in_both(tmp_path):
    """A 2.1 that uses a constant of its own cell: graded as it is, and notebook 08 trains the same.

    Fails on the code before the one reader (af84bb6), checked by running this test against a
    scratch copy of that commit's course_lib: collection took the cell's imports and its ``def
    causal_mask`` only (helpers: one level of ``def``/``class`` of earlier cells, never assignments,
    never the same cell's), so its source lacked ``future`` and ``KEEP_DIAGONAL`` and differed from
    the graded one; notebook 08 called the part "yours" and its GPT raised NameError, while
    ``python -m course_lib grade`` passed it.
    """
    from course_lib.classroom.collect import collect_student_parts, course_exercises
    from course_lib.classroom.grading.judge import judge, known_names
    from course_lib.classroom.grading.plan import grading_plan
    from course_lib.classroom.grading.sources import student_part

    exercise = course_exercises()["2.1"]
    path = tmp_path / exercise.notebook
    shutil.copy(ROOT / "notebooks" / exercise.notebook, path)
    nb = nbformat.read(path, as_version=4)
    index = next(i for i, cell in enumerate(nb.cells) if cell.get("id") == exercise.cell_id)
    nb.cells[index].source = ("KEEP_DIAGONAL = 0\n\n\ndef future(seq_len):\n"
                              "    return torch.ones(seq_len, seq_len).tril(KEEP_DIAGONAL)\n\n\n"
                              "def causal_mask(seq_len):\n    return future(seq_len).bool()\n")
    nbformat.write(nb, path)

    collection = collect_student_parts(tmp_path, ["2.1"])
    part = collection.parts["2.1"]
    plans = grading_plan(["2.1"])
    graded = student_part(path.read_text(encoding="utf-8"), plans["2.1"], known_names(plans))
    assert part.status == "yours", part.detail
    assert part.source == graded.source and "KEEP_DIAGONAL = 0" in part.source
    assert judge(plans["2.1"], graded.source)["passed"]
    yours = collection.namespace(["2.1"])["causal_mask"](4)   # what notebook 08's GPT calls
    assert torch.equal(yours, torch.ones(4, 4).tril().bool())



def test_a_registration_on_a_needed_function_is_taken_whatever_order_the_names_are_followed_in(reader):
    """The names a definition reads are followed in a set's order (it differs with the names and between processes):
    the registration must be found whichever name comes last (it was lost when the last one followed had been seen
    before). Thirty helpers' names give thirty orders."""
    for index in range(30):
        helper = f"helper_{index}_{'x' * (index % 7)}"
        cells = _cells("import functools, operator\n@functools.singledispatch\ndef size(x):\n    raise TypeError(x)\n",
                       f"def {helper}(n):\n    return size(n)\n", "@size.register\ndef _(x: int):\n    return x\n",
                       f"def causal_mask(n):\n    k = functools.reduce(operator.add, [0, size(n), {helper}(n)])\n"
                       f"    return torch.ones(k, k).tril().bool()\n", ids=("a", "b", "c", "exercise"))
        found = reader.student_definition(cells, "causal_mask", "exercise", KNOWN)
        assert "@size.register" in found.source, helper
        assert torch.equal(_run(found.source, "causal_mask")(2), torch.ones(4, 4).tril().bool())

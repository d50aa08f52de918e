"""Learner copies: solution regions replaced, outputs cleared, everything else kept."""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

import nbformat
import pytest
from nbformat import v4

from course_lib.classroom import assignments
from course_lib.classroom.assignments import make_learner_copies, make_learner_copy, strip_solutions

ROOT = Path(__file__).resolve().parents[1]
REPO_NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

SETUP = "import math\n\nSCALE = 2\n"

CLASS_CELL = '''\
# Exercise 2.2: write MaskedAttention.forward
class MaskedAttention:
    def __init__(self, embed_dim):
        self.embed_dim = embed_dim  # kept: outside the region

    def forward(self, x):
        ### BEGIN SOLUTION (Exercise 2.2: write MaskedAttention.forward)
        y = x * SCALE
        return y + self.embed_dim
        ### END SOLUTION

    def extra_repr(self):
        return f"embed_dim={self.embed_dim}"
'''

COMMENT_CELL = '''\
# Exercise 3.3: write split_heads
def split_heads(x, num_heads):
    ### BEGIN SOLUTION
    return [x[i::num_heads] for i in range(num_heads)]
    ### END SOLUTION
'''

TWO_REGIONS_CELL = '''\
def causal_mask(n):
    ### BEGIN SOLUTION (Exercise 2.1: build the lower-triangular mask)
    return [[j <= i for j in range(n)] for i in range(n)]
    ### END SOLUTION


def merge_heads(parts):
    """Kept docstring."""
    ### BEGIN SOLUTION (Exercise 3.2: concatenate the heads)
    out = []
    for part in parts:
        out.extend(part)
    return out
    ### END SOLUTION
'''

TOP_LEVEL_CELL = '''\
### BEGIN SOLUTION
weights = [0.5, 0.5]
### END SOLUTION
print("after")
'''

MARKDOWN = "## Masked attention\n\nWrite `forward` between the markers:\n\n    ### BEGIN SOLUTION\n"


def _raise_line(indent: str, label: str) -> str:
    return f'{indent}raise NotImplementedError("{label}")'


def _build_notebook(path: Path) -> Path:
    """A small solution notebook: outputs, markdown, metadata, and four kinds of regions."""
    stream = v4.new_output("stream", name="stdout", text="42\n")
    result = v4.new_output("execute_result", data={"text/plain": "3"}, execution_count=4)
    cells = [
        v4.new_markdown_cell(MARKDOWN),
        v4.new_code_cell(SETUP, execution_count=1, outputs=[stream]),
        v4.new_code_cell(CLASS_CELL, execution_count=2,
                         metadata={"tags": ["NBVAL_IGNORE_OUTPUT", "raises-exception"],
                                   "nbgrader": {"solution": True, "grade_id": "ex2_2", "checksum": "abc"},
                                   "execution": {"iopub.execute_input": "2026-01-01T00:00:00Z"},
                                   "scrolled": True}),
        v4.new_code_cell(COMMENT_CELL, execution_count=3, outputs=[result],
                         metadata={"tags": ["nbval-ignore-output"]}),
        v4.new_code_cell(TWO_REGIONS_CELL, execution_count=5),
        v4.new_markdown_cell("The mask keeps **past** tokens.", metadata={"tags": ["keep-me"]}),
        v4.new_code_cell(TOP_LEVEL_CELL, execution_count=6, outputs=[stream]),
    ]
    nb = v4.new_notebook(cells=cells, metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python", "version": "3.11.7"},
        "widgets": {"application/vnd.jupyter.widget-state+json": {"state": {}}},
    })
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def _notebook_with(path: Path, *sources: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(v4.new_notebook(cells=[v4.new_code_cell(s) for s in sources]), path)
    return path


# ---------------------------------------------------------------- strip_solutions


def test_marker_text_labels_the_region_at_the_marker_indentation():
    out = strip_solutions(CLASS_CELL)
    lines = out.splitlines()
    i = lines.index("        # YOUR CODE HERE: write MaskedAttention.forward")
    assert lines[i + 1] == _raise_line(" " * 8, "Exercise 2.2: write MaskedAttention.forward")
    assert "SCALE" not in out and "BEGIN SOLUTION" not in out and "END SOLUTION" not in out
    compile(out, "class_cell", "exec")


def test_code_outside_regions_is_kept_byte_for_byte():
    out = strip_solutions(CLASS_CELL)
    before, after = CLASS_CELL.split("        ### BEGIN SOLUTION")[0], CLASS_CELL.split("### END SOLUTION\n")[1]
    assert out.startswith(before)
    assert out.endswith(after)
    assert out == before + ("        # YOUR CODE HERE: write MaskedAttention.forward\n"
                            + _raise_line(" " * 8, "Exercise 2.2: write MaskedAttention.forward") + "\n"
                            + after)


def test_a_method_whose_body_is_only_the_raise_compiles_and_raises_when_called():
    namespace: dict = {}
    exec(compile(SETUP + strip_solutions(CLASS_CELL), "cell", "exec"), namespace)
    module = namespace["MaskedAttention"](4)
    assert module.extra_repr() == "embed_dim=4"  # code after the region still works
    with pytest.raises(NotImplementedError, match=r"^Exercise 2\.2: write MaskedAttention\.forward$"):
        module.forward(1)


def test_marker_without_text_uses_the_preceding_exercise_comment():
    out = strip_solutions(COMMENT_CELL)
    assert out == ("# Exercise 3.3: write split_heads\n"
                   "def split_heads(x, num_heads):\n"
                   "    # YOUR CODE HERE: write split_heads\n"
                   + _raise_line("    ", "Exercise 3.3: write split_heads") + "\n")


def test_marker_text_without_an_id_borrows_the_comment_id():
    src = "# Exercise 4.1: build the table\ndef f():\n    ### BEGIN SOLUTION (use sin on even columns)\n    return 1\n    ### END SOLUTION\n"
    assert _raise_line("    ", "Exercise 4.1: use sin on even columns") in strip_solutions(src)


def test_description_of_another_exercise_is_not_borrowed():
    src = "# Exercise 2.1: write causal_mask\n### BEGIN SOLUTION (Exercise 2.2)\nx = 1\n### END SOLUTION\n"
    assert _raise_line("", "Exercise 2.2: write this part") in strip_solutions(src)


def test_without_any_label_falls_back_to_hint_then_default():
    assert _raise_line("", "Exercise: write this part") in strip_solutions(TOP_LEVEL_CELL)
    hinted = strip_solutions(TOP_LEVEL_CELL, exercise_hint="Exercise 1.1: predict the weights")
    assert "# YOUR CODE HERE: predict the weights\n" in hinted
    assert _raise_line("", "Exercise 1.1: predict the weights") in hinted


def test_several_regions_in_one_cell_each_get_their_own_label():
    out = strip_solutions(TWO_REGIONS_CELL)
    assert out.count("raise NotImplementedError") == 2
    assert _raise_line("    ", "Exercise 2.1: build the lower-triangular mask") in out
    assert _raise_line("    ", "Exercise 3.2: concatenate the heads") in out
    assert '    """Kept docstring."""\n' in out and "out.extend" not in out
    namespace: dict = {}
    exec(compile(out, "cell", "exec"), namespace)
    with pytest.raises(NotImplementedError, match="Exercise 3.2"):
        namespace["merge_heads"]([[1], [2]])


def test_tabs_crlf_and_quotes_survive():
    src = 'def f():\r\n\t### BEGIN SOLUTION (Exercise 9.9: say "hi" \\ there)\r\n\treturn 1\r\n\t### END SOLUTION\r\nx = 2\r\n'
    out = strip_solutions(src)
    assert out.startswith("def f():\r\n\t# YOUR CODE HERE: say")
    assert out.endswith("\r\nx = 2\r\n")
    namespace: dict = {}
    exec(compile(out, "cell", "exec"), namespace)
    with pytest.raises(NotImplementedError) as info:
        namespace["f"]()
    assert str(info.value) == 'Exercise 9.9: say "hi" \\ there'


def test_source_without_markers_is_returned_unchanged():
    src = "x = 1  # ### not a marker\n%matplotlib inline\n"
    assert strip_solutions(src) == src


@pytest.mark.parametrize("source, line, words", [
    ("x = 1\n### END SOLUTION\n", 2, "without a matching '### BEGIN SOLUTION'"),
    ("def f():\n    ### BEGIN SOLUTION\n    return 1\n", 2, "without a matching '### END SOLUTION'"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\nx\n### END SOLUTION\n### END SOLUTION\n", 2, "nested"),
    ("## BEGIN SOLUTION\nx = 1\n## END SOLUTION\n", 1, "looks like a solution marker"),
    ("### BEGIN SOLUTION Exercise 2.2\nx = 1\n### END SOLUTION\n", 1, "looks like a solution marker"),
])
def test_bad_markers_name_the_cell_and_line(source, line, words):
    with pytest.raises(ValueError) as info:
        strip_solutions(source, cell_label="notebook 02_masked_attention.ipynb, cell 14")
    message = str(info.value)
    assert message.startswith(f"notebook 02_masked_attention.ipynb, cell 14, line {line}:")
    assert words in message


def test_marker_indented_less_than_the_code_is_refused_instead_of_breaking_the_cell():
    src = "def f():\n### BEGIN SOLUTION\n    return 1\n### END SOLUTION\n"
    with pytest.raises(ValueError, match="cell 3: the learner copy of this cell would not compile"):
        strip_solutions(src, cell_label="cell 3")


@pytest.mark.parametrize("kwargs, name", [
    ({"source": b"x"}, "source"),
    ({"source": "x", "exercise_hint": 2.2}, "exercise_hint"),
    ({"source": "x", "cell_label": 14}, "cell_label"),
])
def test_strip_solutions_checks_argument_types(kwargs, name):
    with pytest.raises(TypeError, match=rf"^{name}: expected .* got "):
        strip_solutions(**kwargs)


# ---------------------------------------------------------------- make_learner_copy


def test_learner_copy_clears_outputs_and_keeps_everything_else(tmp_path):
    src = _build_notebook(tmp_path / "src" / "02_masked_attention.ipynb")
    counts = make_learner_copy(src, tmp_path / "out" / "02_masked_attention.ipynb")
    assert counts == {"regions": 5, "exercises": 5, "cells": 7, "code_cells": 5}

    before = nbformat.read(src, as_version=4)
    after = nbformat.read(tmp_path / "out" / "02_masked_attention.ipynb", as_version=4)
    nbformat.validate(after)
    assert len(after.cells) == len(before.cells)
    for old, new in zip(before.cells, after.cells):
        assert new.cell_type == old.cell_type and new.id == old.id
        if new.cell_type == "markdown":
            assert new == old  # source, metadata, everything
            continue
        assert new.outputs == [] and new.execution_count is None
        assert new.source == strip_solutions(old.source)
        assert new.metadata.get("tags") == old.metadata.get("tags")
    assert after.cells[1].source == SETUP  # no region: byte for byte
    class_meta = after.cells[2].metadata
    assert class_meta["tags"] == ["NBVAL_IGNORE_OUTPUT", "raises-exception"]
    assert "nbgrader" not in class_meta and "execution" not in class_meta
    assert class_meta["scrolled"] is True
    assert after.metadata.kernelspec == before.metadata.kernelspec
    assert after.metadata.language_info == before.metadata.language_info
    assert "widgets" not in after.metadata
    assert (after.nbformat, after.nbformat_minor) == (before.nbformat, before.nbformat_minor)


def test_learner_copy_labels_every_region(tmp_path):
    src = _build_notebook(tmp_path / "nb.ipynb")
    make_learner_copy(src, tmp_path / "copy.ipynb")
    text = (tmp_path / "copy.ipynb").read_text(encoding="utf-8")
    labels = re.findall(r'raise NotImplementedError\(\\"(.*?)\\"\)', text)
    assert labels == ["Exercise 2.2: write MaskedAttention.forward", "Exercise 3.3: write split_heads",
                      "Exercise 2.1: build the lower-triangular mask", "Exercise 3.2: concatenate the heads",
                      "Exercise: write this part"]
    assert "SCALE * " not in text and "x * SCALE" not in text and "weights = [0.5" not in text


def test_bad_marker_names_notebook_and_cell_and_writes_nothing(tmp_path):
    src = _notebook_with(tmp_path / "03_heads.ipynb", "x = 1\n", "y = 2\n### END SOLUTION\n")
    out = tmp_path / "out" / "03_heads.ipynb"
    with pytest.raises(ValueError, match=r"^notebook 03_heads\.ipynb, cell 2, line 2: '### END SOLUTION'"):
        make_learner_copy(src, out)
    assert not out.exists()


def test_failed_write_leaves_no_temp_file_and_keeps_the_old_copy(tmp_path, monkeypatch):
    src = _build_notebook(tmp_path / "nb.ipynb")
    out = tmp_path / "out" / "nb.ipynb"
    out.parent.mkdir()
    out.write_text("previous copy", encoding="utf-8")

    def broken_write(nb, handle, **kwargs):
        handle.write("{half")
        raise OSError("disk full")

    monkeypatch.setattr(assignments.nbformat, "writes", lambda nb, **kwargs: broken_write(nb, io.StringIO()))
    with pytest.raises(OSError, match="disk full"):
        make_learner_copy(src, out)
    assert out.read_text(encoding="utf-8") == "previous copy"
    assert [p.name for p in out.parent.iterdir()] == ["nb.ipynb"]


def test_learner_copy_refuses_to_overwrite_its_source(tmp_path):
    src = _build_notebook(tmp_path / "nb.ipynb")
    with pytest.raises(ValueError, match="out_path: .*overwrite the solutions"):
        make_learner_copy(src, tmp_path / "." / "nb.ipynb")


def test_learner_copy_checks_its_arguments(tmp_path):
    with pytest.raises(TypeError, match=r"^notebook_path: expected a path .* got 3 \(int\)"):
        make_learner_copy(3, tmp_path / "x.ipynb")
    with pytest.raises(FileNotFoundError, match=r"^notebook_path: expected an existing \.ipynb file.*not found"):
        make_learner_copy(tmp_path / "missing.ipynb", tmp_path / "x.ipynb")
    (tmp_path / "broken.ipynb").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=r"^notebook_path: could not read .*broken\.ipynb"):
        make_learner_copy(tmp_path / "broken.ipynb", tmp_path / "x.ipynb")


# ---------------------------------------------------------------- make_learner_copies


def test_copies_every_notebook_sorted_and_nothing_else(tmp_path):
    src_dir = tmp_path / "notebooks"
    _build_notebook(src_dir / "02_masked_attention.ipynb")
    _notebook_with(src_dir / "01_attention_toy.ipynb", "print(1)\n")
    _notebook_with(src_dir / "01_attention_toy-checkpoint.ipynb", "print(1)\n")
    _notebook_with(src_dir / ".ipynb_checkpoints" / "02_masked_attention-checkpoint.ipynb", "x\n")
    _notebook_with(src_dir / "sub" / "04_nested.ipynb", "x\n")
    (src_dir / "notes.txt").write_text("not a notebook", encoding="utf-8")

    out_dir = tmp_path / "student" / "copies"
    written = make_learner_copies(src_dir, out_dir)
    assert written == [out_dir / "01_attention_toy.ipynb", out_dir / "02_masked_attention.ipynb"]
    assert sorted(p.name for p in out_dir.iterdir()) == [".course-copies.json", "01_attention_toy.ipynb",
                                                         "02_masked_attention.ipynb"]


def test_copies_are_all_or_nothing(tmp_path):
    src_dir = tmp_path / "notebooks"
    _build_notebook(src_dir / "01_good.ipynb")
    _notebook_with(src_dir / "02_bad.ipynb", "def f():\n    ### BEGIN SOLUTION\n    return 1\n")
    with pytest.raises(ValueError, match=r"notebook 02_bad\.ipynb, cell 1, line 2"):
        make_learner_copies(src_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_copies_refuse_the_source_folder_as_output(tmp_path):
    src_dir = tmp_path / "notebooks"
    original = _build_notebook(src_dir / "01.ipynb").read_bytes()
    with pytest.raises(ValueError, match=r"^out_dir: expected a folder other than src_dir.*overwrite the solution"):
        make_learner_copies(src_dir, tmp_path / "notebooks" / ".." / "notebooks")
    assert (src_dir / "01.ipynb").read_bytes() == original


def test_copies_check_their_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^src_dir: expected an existing folder.*not found"):
        make_learner_copies(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "file").write_text("", encoding="utf-8")
    _notebook_with(tmp_path / "nbs" / "a.ipynb", "x = 1\n")
    with pytest.raises(NotADirectoryError, match=r"^out_dir: expected a folder .* which is a file"):
        make_learner_copies(tmp_path / "nbs", tmp_path / "file")
    with pytest.raises(TypeError, match=r"^src_dir: expected a path"):
        make_learner_copies(None, tmp_path / "out")


# ---------------------------------------------------------------- CLI


def test_cli_writes_copies_and_reports_each(tmp_path, capsys):
    src_dir = tmp_path / "notebooks"
    _build_notebook(src_dir / "02_masked_attention.ipynb")
    _notebook_with(src_dir / "01_attention_toy.ipynb",
                   "### BEGIN SOLUTION (Exercise 1.1: predict)\nw = 1\n### END SOLUTION\n")
    out_dir = tmp_path / "OUT"
    assert assignments.main([str(src_dir), str(out_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"created    {out_dir / '01_attention_toy.ipynb'} (1 exercise)",
                     f"created    {out_dir / '02_masked_attention.ipynb'} (5 exercises)"]
    assert assignments.main([str(src_dir), str(out_dir)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"up to date {out_dir / '01_attention_toy.ipynb'}",
                                                    f"up to date {out_dir / '02_masked_attention.ipynb'}"]


@pytest.mark.parametrize("case", ["bad_marker", "missing_src", "same_dir", "no_notebooks", "usage"])
def test_cli_returns_2_with_a_message(tmp_path, capsys, case):
    src_dir = tmp_path / "notebooks"
    src_dir.mkdir()
    if case == "bad_marker":
        _notebook_with(src_dir / "01.ipynb", "### END SOLUTION\n")
    argv = {"bad_marker": [str(src_dir), str(tmp_path / "out")],
            "missing_src": [str(tmp_path / "nope"), str(tmp_path / "out")],
            "same_dir": [str(src_dir), str(src_dir)],
            "no_notebooks": [str(src_dir), str(tmp_path / "out")],
            "usage": [str(src_dir)]}[case]
    assert assignments.main(argv) == 2
    err = capsys.readouterr().err
    expected = {"bad_marker": "error: notebook 01.ipynb, cell 1, line 1",
                "missing_src": "error: src_dir: expected an existing folder",
                "same_dir": "error: out_dir: expected a folder other than src_dir",
                "no_notebooks": "error: src_dir: expected a folder containing *.ipynb notebooks",
                "usage": "usage: python -m course_lib student"}[case]
    assert expected in err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- round trip and execution


def _assert_round_trip(src: Path, out: Path) -> None:
    """The learner copy of ``src`` is complete, compiles and leaks no solution."""
    make_learner_copy(src, out)
    before, after = nbformat.read(src, as_version=4), nbformat.read(out, as_version=4)
    assert [c.cell_type for c in after.cells] == [c.cell_type for c in before.cells]
    number = re.match(r"(\d+)_", src.name)
    for index, (old, new) in enumerate(zip(before.cells, after.cells), start=1):
        where = f"{src.name}, cell {index}"
        if new.cell_type != "code":
            assert new == old, where
            continue
        assert new.outputs == [] and new.execution_count is None, where
        assert "BEGIN SOLUTION" not in new.source and "END SOLUTION" not in new.source, where
        assert assignments._compiles(new.source) is None, where
        if "### BEGIN SOLUTION" not in old.source:
            assert new.source == old.source, where
        for label in re.findall(r'raise NotImplementedError\("(.*?)"\)', new.source):
            # Every region must name its exercise, and the id must belong to this notebook.
            assert re.fullmatch(r"Exercise \d+\.\d+: .+", label), f"{where}: unnamed region {label!r}"
            if number:
                assert label.startswith(f"Exercise {int(number[1])}."), f"{where}: {label!r}"


@pytest.mark.parametrize("notebook", ["built-in sample"] + REPO_NOTEBOOKS,
                         ids=lambda n: n if isinstance(n, str) else n.name)
def test_round_trip(notebook, tmp_path):
    # The built-in sample keeps this test running (never an empty parameter set) before notebooks/ exists.
    if notebook == "built-in sample":
        notebook = _notebook_with(tmp_path / "src" / "02_sample.ipynb", COMMENT_CELL.replace("3.3", "2.3"),
                                  CLASS_CELL, "print('no region')\n")
    _assert_round_trip(notebook, tmp_path / "learner" / notebook.name)


def _has_kernel(name: str) -> bool:
    try:
        from jupyter_client.kernelspec import KernelSpecManager
        return name in KernelSpecManager().find_kernel_specs()
    except Exception:
        return False


def test_learner_copy_runs_top_to_bottom(tmp_path):
    """Defining a function whose body raises is fine; only calling it would fail."""
    src = _notebook_with(tmp_path / "01_tiny.ipynb", SETUP, CLASS_CELL, COMMENT_CELL, TWO_REGIONS_CELL,
                         "try:\n    split_heads([1, 2], 2)\nexcept NotImplementedError as err:\n"
                         "    print('checker says:', err)\nprint('reached the end')\n")
    out = tmp_path / "learner" / "01_tiny.ipynb"
    make_learner_copy(src, out)
    nb = nbformat.read(out, as_version=4)
    if _has_kernel("python3"):
        from nbclient import NotebookClient
        NotebookClient(nb, timeout=60, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
        printed = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    else:  # no Jupyter kernel installed: run the cells in one namespace, in order
        namespace: dict = {}
        import contextlib
        import io
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            for cell in nb.cells:
                exec(compile(cell.source, "cell", "exec"), namespace)
        printed = buffer.getvalue()
    assert printed == "checker says: Exercise 3.3: write split_heads\nreached the end\n"


# ---------------------------------------------------------------- a student's work is never overwritten


def _course(src_dir: Path, *extra_sources: str) -> Path:
    """A one-notebook course; ``extra_sources`` stand for what a later version of the course adds."""
    return _notebook_with(src_dir / "01_attention_toy.ipynb",
                          "### BEGIN SOLUTION (Exercise 1.1: predict)\nw = 1\n### END SOLUTION\n",
                          "print(w)\n", *extra_sources)


def _edit(path: Path, new_source: str) -> bytes:
    nb = nbformat.read(path, as_version=4)
    nb.cells[0].source = new_source
    nbformat.write(nb, path)
    return path.read_bytes()


def _update(src_dir: Path, out_dir: Path) -> dict[str, str]:
    return {o.path.name: o.action for o in assignments.update_learner_copies(src_dir, out_dir)}


def test_regenerating_keeps_the_students_edit_and_writes_the_new_version_beside_it(tmp_path, capsys):
    src_dir, out_dir = tmp_path / "notebooks", tmp_path / "student"
    _course(src_dir)
    assert assignments.main([str(src_dir), str(out_dir)]) == 0
    mine = out_dir / "01_attention_toy.ipynb"
    edited = _edit(mine, "w = 0.5  # my answer\n")
    _course(src_dir, "print('a cell the course added later')\n")   # a git pull changed the course
    capsys.readouterr()

    assert assignments.main([str(src_dir), str(out_dir)]) == 0
    line = capsys.readouterr().out.strip()
    updated = out_dir / "01_attention_toy.updated.ipynb"
    assert line == (f"kept       {mine}: it holds your work, so it was not touched; "
                    f"the course's new version is {updated}")
    assert mine.read_bytes() == edited, "the student's copy is byte for byte what they saved"
    new = nbformat.read(updated, as_version=4)
    assert [c.source for c in new.cells][1:] == ["print(w)\n", "print('a cell the course added later')\n"]
    assert "NotImplementedError" in new.cells[0].source

    # Running it again changes nothing: the new version is already beside the student's copy.
    assert _update(src_dir, out_dir) == {"01_attention_toy.ipynb": "kept"}
    assert mine.read_bytes() == edited
    assert sorted(p.name for p in out_dir.glob("*.ipynb")) == ["01_attention_toy.ipynb",
                                                               "01_attention_toy.updated.ipynb"]


def test_an_edited_copy_of_an_unchanged_course_is_kept_with_nothing_written_beside_it(tmp_path, capsys):
    src_dir, out_dir = tmp_path / "notebooks", tmp_path / "student"
    _course(src_dir)
    _update(src_dir, out_dir)
    mine = out_dir / "01_attention_toy.ipynb"
    edited = _edit(mine, "w = 0.5\n")
    assert assignments.main([str(src_dir), str(out_dir)]) == 0
    assert capsys.readouterr().out.strip() == f"kept       {mine}: it holds your work, and the course has not changed"
    assert mine.read_bytes() == edited
    assert sorted(p.name for p in out_dir.glob("*.ipynb")) == ["01_attention_toy.ipynb"]


def test_a_copy_the_student_never_changed_is_refreshed_even_after_running_it(tmp_path):
    src_dir, out_dir = tmp_path / "notebooks", tmp_path / "student"
    _course(src_dir)
    assert _update(src_dir, out_dir) == {"01_attention_toy.ipynb": "created"}
    assert _update(src_dir, out_dir) == {"01_attention_toy.ipynb": "up to date"}
    mine = out_dir / "01_attention_toy.ipynb"
    ran = nbformat.read(mine, as_version=4)   # what JupyterLab saves after "Run All": outputs, counts, metadata
    ran.cells[1].outputs = [v4.new_output("stream", name="stdout", text="1\n")]
    ran.cells[1].execution_count = 1
    ran.metadata["widgets"] = {"state": {}}
    nbformat.write(ran, mine)
    _course(src_dir, "print('new')\n")
    assert _update(src_dir, out_dir) == {"01_attention_toy.ipynb": "refreshed"}
    assert [c.source for c in nbformat.read(mine, as_version=4).cells][-1] == "print('new')\n"
    assert not (out_dir / "01_attention_toy.updated.ipynb").exists()


def test_without_the_record_a_differing_copy_counts_as_the_students(tmp_path):
    src_dir, out_dir = tmp_path / "notebooks", tmp_path / "student"
    _course(src_dir)
    _update(src_dir, out_dir)
    (out_dir / ".course-copies.json").unlink()
    before = (out_dir / "01_attention_toy.ipynb").read_bytes()
    _course(src_dir, "print('new')\n")
    assert _update(src_dir, out_dir) == {"01_attention_toy.ipynb": "kept"}
    assert (out_dir / "01_attention_toy.ipynb").read_bytes() == before
    assert (out_dir / "01_attention_toy.updated.ipynb").exists()


@pytest.mark.parametrize("damage", ["not a notebook", "record is garbage"])
def test_an_unreadable_copy_or_record_is_kept_not_overwritten(tmp_path, damage):
    src_dir, out_dir = tmp_path / "notebooks", tmp_path / "student"
    _course(src_dir)
    _update(src_dir, out_dir)
    mine = out_dir / "01_attention_toy.ipynb"
    if damage == "not a notebook":
        mine.write_text("{half a notebook", encoding="utf-8")
    else:
        _edit(mine, "w = 2\n")
        (out_dir / ".course-copies.json").write_text("[1, 2", encoding="utf-8")
    before = mine.read_bytes()
    _course(src_dir, "print('new')\n")
    assert _update(src_dir, out_dir) == {"01_attention_toy.ipynb": "kept"}
    assert mine.read_bytes() == before


def test_an_edited_updated_version_is_kept_too(tmp_path):
    src_dir, out_dir = tmp_path / "notebooks", tmp_path / "student"
    _course(src_dir)
    _update(src_dir, out_dir)
    _edit(out_dir / "01_attention_toy.ipynb", "w = 3\n")
    _course(src_dir, "print('v2')\n")
    _update(src_dir, out_dir)
    updated = out_dir / "01_attention_toy.updated.ipynb"
    edited_update = _edit(updated, "w = 4  # I worked in the updated copy\n")
    _course(src_dir, "print('v3')\n")
    outcomes = assignments.update_learner_copies(src_dir, out_dir)
    assert [o.action for o in outcomes] == ["kept"]
    assert outcomes[0].new_version == out_dir / "01_attention_toy.updated-2.ipynb"
    assert updated.read_bytes() == edited_update
    assert nbformat.read(outcomes[0].new_version, as_version=4).cells[-1].source == "print('v3')\n"


def test_make_learner_copy_follows_the_same_rule(tmp_path):
    src = _course(tmp_path / "notebooks")
    out = tmp_path / "student" / "01_attention_toy.ipynb"
    make_learner_copy(src, out)
    edited = _edit(out, "w = 7\n")
    _course(tmp_path / "notebooks", "print('new')\n")
    make_learner_copy(src, out)
    assert out.read_bytes() == edited
    assert (out.parent / "01_attention_toy.updated.ipynb").exists()
    record = json.loads((out.parent / ".course-copies.json").read_text())
    assert set(record["written"]) == {"01_attention_toy.ipynb", "01_attention_toy.updated.ipynb"}


def test_start_writes_the_shipped_course_into_attention_course_and_says_how_to_open_it(tmp_path, monkeypatch,
                                                                                      capsys):
    monkeypatch.chdir(tmp_path)
    assert assignments.start_main([]) == 0
    out = capsys.readouterr().out
    folder = tmp_path / "attention-course"
    names = sorted(p.name for p in folder.glob("*.ipynb"))
    assert names == [p.name for p in REPO_NOTEBOOKS]
    assert out.count("created    ") == len(REPO_NOTEBOOKS)
    assert f"jupyter lab {Path('attention-course') / names[0]}" in out
    for path in folder.glob("*.ipynb"):
        assert "### BEGIN SOLUTION" not in path.read_text(encoding="utf-8"), f"{path.name} leaks a solution"
    assert assignments.start_main(["mine"]) == 0 and (tmp_path / "mine" / names[0]).is_file()
    assert assignments.start_main(["--nope"]) == 2

"""Structure of the committed notebooks: a clean run, the course kernel, goals and recap, exercises.

These tests read the .ipynb files; they do not execute them (nbval does that, see the Makefile).
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

import nbformat
import pytest

from course_lib.classroom import checks
from course_lib.classroom.assignments import strip_solutions
from course_lib.classroom.exercises import BY_ID as EXERCISES  # "2.2" -> its exercise

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
KERNEL = "python3"   # the kernel every Jupyter has; `make lab` runs it from the course venv
IGNORE_TAG = "nbval-ignore-output"

# The course map: number -> file stem, in teaching order.
EXPECTED_NAMES = {
    "01": "01_attention_toy",
    "02": "02_masked_attention",
    "03": "03_multi_head_attention",
    "04": "04_transformer_blocks",
    "05": "05_training_gpt",
    "06": "06_fast_attention_and_generation",
    "07": "07_huggingface_and_scaling",
    "08": "08_train_your_gpt",
    "09": "09_modern_attention",
    "10": "10_flash_attention",
    "11": "11_what_attention_learns",
    "12": "12_where_attention_is_going",
}
# Notebooks whose exercise is the student's earlier work put together, judged by one checker call
# instead of a solution region of their own.
ASSEMBLED_EXERCISES = {"08_train_your_gpt": "checks.check_trains_like_reference("}

_BEGIN = re.compile(r"^[ \t]*### BEGIN SOLUTION\b", re.MULTILINE)
_STRIPPED_ID = re.compile(r'raise NotImplementedError\("Exercise (\d+(?:\.\d+)*[a-z]?)\b')
_CHECK_CALL = re.compile(r"\bchecks\.(check_\w+)\s*\(")
_TIME = re.compile(r"\b\d+\s*(?:minutes?|mins?|hours?)\b", re.IGNORECASE)
# the last notebook of the course may point onwards instead ("Where to go from here")
_WHATS_NEXT = re.compile(r"what[’']?s next|where to go (?:from here|next)", re.IGNORECASE)
_MD_IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)")
_HTML_IMAGE = re.compile(r"<img\b[^>]*?\bsrc\s*=\s*[\"']?([^\"'\s>]+)", re.IGNORECASE)


def _ids(paths: list[Path]) -> list[str]:
    return [p.name for p in paths]


def _read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def _number(path: Path) -> str:
    return path.name[:2]


def _code_cells(nb: nbformat.NotebookNode) -> list[tuple[int, nbformat.NotebookNode]]:
    return [(i, c) for i, c in enumerate(nb.cells, start=1) if c.cell_type == "code"]


def _markdown(nb: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [c for c in nb.cells if c.cell_type == "markdown"]


def test_there_are_notebooks():
    assert NOTEBOOKS, f"expected notebooks in {NOTEBOOK_DIR}, found none"


def test_notebooks_are_numbered_contiguously_with_the_expected_names():
    names = [p.stem for p in NOTEBOOKS]
    unexpected = [n for n in names if n not in EXPECTED_NAMES.values()]
    assert not unexpected, (f"unexpected notebook name(s) {unexpected}; the course map is "
                            f"{list(EXPECTED_NAMES.values())}")
    numbers = sorted(n[:2] for n in names)
    assert numbers == list(EXPECTED_NAMES)[:len(numbers)], (
        f"notebooks must be numbered 01, 02, ... without gaps; found {numbers}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_kernel_is_the_standard_python3_kernel(path):
    spec = _read(path).metadata.get("kernelspec", {})
    assert spec.get("name") == KERNEL, (f"{path.name}: kernelspec name should be {KERNEL!r}, got "
                                        f"{spec.get('name')!r}; execute with --ExecutePreprocessor.kernel_name={KERNEL}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_execution_counts_are_one_clean_run(path):
    counts = [cell.execution_count for _, cell in _code_cells(_read(path))]
    assert counts == list(range(1, len(counts) + 1)), (
        f"{path.name}: execution counts should be 1..{len(counts)} in order (one clean top-to-bottom run), "
        f"got {counts}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_no_saved_errors(path):
    errors = [(i, out.get("ename")) for i, cell in _code_cells(_read(path)) for out in cell.outputs
              if out.output_type == "error"]
    assert not errors, f"{path.name}: saved error output(s) in cells {errors}"


def _outside_repo(ref: str, base: Path) -> str | None:
    """Why an image reference points outside the repository, or None when it is fine."""
    ref = ref.strip()
    lowered = ref.lower()
    if lowered.startswith(("attachment:", "data:image/")):
        return None
    if re.match(r"^[a-z][a-z0-9+.\-]*:", lowered) or lowered.startswith("//"):
        return "a URL"
    path = Path(unquote(ref.split("#")[0].split("?")[0]))
    if path.is_absolute() or ref.startswith(("/", "\\", "~")) or re.match(r"^[a-zA-Z]:[\\/]", ref):
        return "an absolute path"
    resolved = (base / path).resolve()
    if ROOT.resolve() not in resolved.parents:
        return "a path outside the repository"
    if not resolved.exists():
        return "a file that does not exist in the repository"
    return None


def _image_refs(text: str) -> list[str]:
    return _MD_IMAGE.findall(text) + _HTML_IMAGE.findall(text)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_no_images_from_outside_the_repository(path):
    problems = []
    for i, cell in enumerate(_read(path).cells, start=1):
        texts = [cell.source]
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            texts += [data.get(kind, "") for kind in ("text/html", "text/markdown")]
        for text in texts:
            text = "".join(text) if isinstance(text, list) else text
            for ref in _image_refs(text):
                why = _outside_repo(ref, path.parent)
                if why:
                    problems.append(f"cell {i}: {ref!r} is {why}")
    assert not problems, (f"{path.name}: images must be drawn (matplotlib, course_lib.viz), attached, or "
                          f"stored in the repository: " + "; ".join(problems))


def test_image_reference_rules():
    """The image rule itself: URLs, absolute paths and escapes are refused; attachments pass."""
    base = NOTEBOOK_DIR
    assert _outside_repo("attachment:diagram.png", base) is None
    assert _outside_repo("https://example.org/a.png", base) == "a URL"
    assert _outside_repo("//cdn.example.org/a.png", base) == "a URL"
    assert _outside_repo("/tmp/a.png", base) == "an absolute path"
    assert _outside_repo("../../elsewhere/a.png", base) == "a path outside the repository"
    assert _image_refs('![x](https://e.org/a.png) <img width=3 src="b.png">') == ["https://e.org/a.png", "b.png"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_opens_with_title_goals_and_time(path):
    nb = _read(path)
    assert nb.cells and nb.cells[0].cell_type == "markdown", f"{path.name}: the first cell should be markdown"
    first = nb.cells[0].source
    assert re.match(r"\s*# ", first), f"{path.name}: the first cell should start with a '# ' title"
    assert re.search(r"learning goals", first, re.IGNORECASE), \
        f"{path.name}: the first cell should list the learning goals under 'Learning goals'"
    assert re.search(r"^\s*[-*] ", first, re.MULTILINE), f"{path.name}: the learning goals should be bullets"
    assert re.search(r"estimated time", first, re.IGNORECASE) and _TIME.search(first), \
        f"{path.name}: the first cell should give an estimated time, e.g. 'Estimated time: about 30 minutes'"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_first_code_cell_sets_up_the_notebook(path):
    # the hosted-kernel set-up cell (course_lib/hosted_setup.py) comes first: it makes the course importable
    code = [(i, cell) for i, cell in _code_cells(_read(path)) if not cell.source.startswith("# [course set-up]")]
    assert code, f"{path.name}: no code cells"
    _, cell = code[0]
    assert "setup_notebook(" in cell.source, \
        f"{path.name}: the first code cell should call setup_notebook (seed, threads, device)"
    assert IGNORE_TAG in cell.metadata.get("tags", []), \
        f"{path.name}: the first code cell prints versions and the device; tag it {IGNORE_TAG!r}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_ends_with_recap_and_whats_next(path):
    nb = _read(path)
    assert nb.cells[-1].cell_type == "markdown", f"{path.name}: the last cell should be markdown (recap)"
    tail = "\n".join(c.source for c in _markdown(nb)[-2:])
    assert re.search(r"\brecap\b", tail, re.IGNORECASE), f"{path.name}: end with a 'Recap' section"
    assert _WHATS_NEXT.search(tail), f"{path.name}: end with a \"What's next\" section"


def _solution_ids(nb: nbformat.NotebookNode) -> tuple[list[str], list[str]]:
    """Exercise ids of the solution regions, as the learner-copy tool labels them; and problems."""
    ids, problems = [], []
    for i, cell in _code_cells(nb):
        regions = len(_BEGIN.findall(cell.source))
        if not regions:
            continue
        # ids the stripping added: any `raise NotImplementedError("Exercise ...")` already there is not a region
        added = (Counter(_STRIPPED_ID.findall(strip_solutions(cell.source, cell_label=f"cell {i}")))
                 - Counter(_STRIPPED_ID.findall(cell.source)))
        found = sorted(added.elements())
        if len(found) != regions:
            problems.append(f"cell {i}: {regions} solution region(s) but {len(found)} with an exercise id; "
                            f"write '### BEGIN SOLUTION (Exercise X.Y: what to write)'")
        ids += found
    return ids, problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_solution_regions_belong_to_this_notebook(path):
    ids, problems = _solution_ids(_read(path))
    assert not problems, f"{path.name}: " + "; ".join(problems)
    number = int(_number(path))
    foreign = sorted({i for i in ids if int(i.split(".")[0]) != number})
    assert not foreign, (f"{path.name}: solution regions for exercise(s) {foreign}, which belong to another "
                         f"notebook; exercises here are numbered {number}.x")


def test_solution_ids_follow_the_learner_copy_labels():
    """Ids come from the marker, or from an '# Exercise X.Y' comment; a region without an id is reported."""
    from nbformat import v4
    nb = v4.new_notebook(cells=[
        v4.new_code_cell("def f():\n    ### BEGIN SOLUTION (Exercise 2.1: write f)\n    return 1\n    ### END SOLUTION\n"),
        v4.new_code_cell("# Exercise 3.2: write g\ndef g():\n    ### BEGIN SOLUTION\n    return 2\n    ### END SOLUTION\n"),
        v4.new_code_cell('raise NotImplementedError("Exercise 9.9: not a region")\n'),
        v4.new_code_cell("def h():\n    ### BEGIN SOLUTION\n    return 3\n    ### END SOLUTION\n"),
    ])
    ids, problems = _solution_ids(nb)
    assert ids == ["2.1", "3.2"]
    assert len(problems) == 1 and problems[0].startswith("cell 4:")


def _checked_ids(path: Path) -> tuple[set[str], list[str]]:
    checked, unknown = set(), []
    for _, cell in _code_cells(_read(path)):
        for name in _CHECK_CALL.findall(cell.source):
            fn = getattr(checks, name, None)
            if fn is None or not hasattr(fn, "exercise"):
                unknown.append(name)
            else:
                checked.add(fn.exercise)
    return checked, unknown


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_every_exercise_is_checked_and_registered(path):
    ids, _ = _solution_ids(_read(path))
    if path.stem in ASSEMBLED_EXERCISES:
        assert not ids and any(ASSEMBLED_EXERCISES[path.stem] in c.source for _, c in _code_cells(_read(path))), \
            f"{path.name}: expected no solution regions and a call to {ASSEMBLED_EXERCISES[path.stem]}...)"
        return
    assert ids, f"{path.name}: no exercises (### BEGIN SOLUTION regions) found"
    checked, unknown = _checked_ids(path)
    assert not unknown, f"{path.name}: calls to unknown checker(s) {unknown} (not in course_lib.classroom.checks)"
    unchecked = sorted(set(ids) - checked)
    assert not unchecked, (f"{path.name}: exercise(s) {unchecked} have no checker call "
                           f"(checks.check_...(...)) in the notebook")
    unregistered = sorted(set(ids) - set(EXERCISES))
    assert not unregistered, (f"{path.name}: exercise(s) {unregistered} are not registered in "
                              f"course_lib.classroom.checks (no hints or solution for checks.hint)")


def test_readme_lists_every_notebook_with_its_time():
    readme = ROOT / "README.md"
    assert readme.is_file(), "README.md is missing; it should list the notebooks with their time estimates"
    lines = readme.read_text(encoding="utf-8").splitlines()
    problems = []
    for path in NOTEBOOKS:
        mentions = [line for line in lines if path.stem in line]
        if not mentions:
            problems.append(f"{path.name} is not listed")
            continue
        if not any(_TIME.search(line) for line in mentions):
            problems.append(f"{path.name} is listed without a time estimate on its line")
            continue
        # the README and the notebook's first cell must give the same estimate
        stated = _TIME.search(_read(path).cells[0].source)
        minutes = stated and re.match(r"\d+", stated.group()).group()
        if minutes and not any(re.search(rf"\b{minutes}\s*(?:minutes?|mins?)\b", line) for line in mentions):
            problems.append(f"{path.name}: the notebook says {stated.group()!r}, the README line does not "
                            f"(expected '{minutes} min' on it)")
    assert not problems, "README.md: " + "; ".join(problems)


# A comparison printed as text ("equal: False") is stored by nbval as the expected output, so a failed
# comparison could be committed and kept; comparison cells assert instead (or call a checker).
_PRINTED_BOOL = re.compile(r"(?:\bequal\w*\s*:\s*False\b|:\s*(?:True|False)\s*$)", re.MULTILINE)
_COMPARING_CALLS = {"equal", "allclose", "isclose", "array_equal", "all", "any"}


def _is_comparison(node) -> bool:
    """True for `a == b`, `x < 1e-5`, `torch.equal(a, b)`, `torch.allclose(...)`, `bool(...)` of those, `not ...`."""
    import ast
    if isinstance(node, ast.Compare):
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return _is_comparison(node.operand)
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name in _COMPARING_CALLS:
            return True
        if name == "bool" and node.args:
            return _is_comparison(node.args[0])
    return False


def _printed_comparisons(source: str) -> list[int]:
    """Line numbers of print(...) calls that print a comparison's result rather than assert it."""
    import ast
    try:
        tree = ast.parse("\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))))
    except SyntaxError:
        return []
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
            values = []
            for arg in node.args:
                if isinstance(arg, ast.JoinedStr):
                    values += [v.value for v in arg.values if isinstance(v, ast.FormattedValue)]
                else:
                    values.append(arg)
            if any(_is_comparison(v) for v in values):
                lines.append(node.lineno)
    return lines


def test_printed_comparison_detector_catches_the_old_cells():
    assert _printed_comparisons('print("same:", torch.allclose(a, b))') == [1]
    assert _printed_comparisons('print(f"equal: {by_hand == n}")') == [1]
    assert _printed_comparisons('x = 1\nprint("ok:", bool((c == 0).all()))') == [2]
    assert _printed_comparisons('print("verified:", a.shape)\nassert torch.equal(a, b), "differ"') == []
    assert _PRINTED_BOOL.search("by hand: 923,904   model.num_parameters(): 911,424   equal: False")
    assert _PRINTED_BOOL.search("output 5 unchanged:    False")
    assert not _PRINTED_BOOL.search("verified: by hand 911,424 == model.num_parameters()")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_comparisons_are_asserted_not_printed(path):
    nb = _read(path)
    printed_source = [(i, n) for i, cell in _code_cells(nb) for n in _printed_comparisons(cell.source)]
    assert not printed_source, (
        f"{path.name}: (cell, line) {printed_source} print a comparison's result; assert it with a message "
        f"and print what was verified, or call a checker, so nbval never stores a failed comparison")
    printed_output = [(i, m.group(0).strip()) for i, cell in _code_cells(nb) for out in cell.outputs
                      if out.output_type == "stream" for m in _PRINTED_BOOL.finditer(out.get("text", ""))]
    assert not printed_output, f"{path.name}: saved output(s) print a comparison's result: {printed_output}"


_FIGURE_NOTE = re.compile(r"^\s*\*The figure:\*\s+\S.{15,}", re.DOTALL)


def _draws_a_figure(cell) -> bool:
    images = ("image/png", "image/svg+xml")
    return cell.cell_type == "code" and any(kind in out.get("data", {}) for out in cell.outputs for kind in images)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_every_figure_has_a_text_description_next_to_it(path):
    """For screen readers and text-only views: a markdown cell '*The figure:* ...' right before or after."""
    cells = _read(path).cells
    missing = []
    for i, cell in enumerate(cells):
        if not _draws_a_figure(cell):
            continue
        neighbours = [cells[j] for j in (i - 1, i + 1) if 0 <= j < len(cells)]
        if not any(c.cell_type == "markdown" and _FIGURE_NOTE.match(c.source) for c in neighbours):
            missing.append(i + 1)
    assert not missing, (f"{path.name}: code cell(s) {missing} (counting all cells from 1) draw a figure without "
                         f"a markdown cell starting '*The figure:* ...' (one sentence: what to look at) right "
                         f"before or after")


def test_figure_description_rule_sees_a_figure_without_one():
    cell = nbformat.v4.new_code_cell("fig", outputs=[nbformat.v4.new_output(
        "execute_result", data={"image/png": "iVBOR", "text/plain": "<Figure>"}, execution_count=1)])
    assert _draws_a_figure(cell)
    assert _FIGURE_NOTE.match("*The figure:* the loss falls, then levels off.")
    assert not _FIGURE_NOTE.match("How to read the curve: the loss falls.")

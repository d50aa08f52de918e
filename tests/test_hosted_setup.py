"""Every notebook's set-up cell: a no-op where the course is installed, and in a kernel without it
(a hosted one: Colab, Kaggle, a JupyterHub) it installs the course beside the kernel's own torch.

The slow tests meet the cell as a hosted kernel would: a fresh venv with only torch (the CPU build) and
Jupyter's kernel, a folder of wheels built from the checkout standing in for the package index. The cell
is the same in every notebook but for the corpora it prepares (a fast test holds that). Learner copies 01 and
05 (no corpus; both corpora and a training) run top to bottom there, each copied alone into an empty folder;
05's run ends with every notebook's imports: torch is the same files after each, and nothing was written into
the installed course. These runs are also those copies' learner-copies run: `make test` leaves them out of
`make learner-copies` (the Makefile's HOSTED_COPIES), so each asserts what nbval-lax asserts there.
What the other notebooks do after their imports is the course's own code, which nbval runs in full.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course_lib import hosted_setup
from course_lib.corpora import CORPORA

try:
    import tomllib
except ImportError:   # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
MARKER = "# [course set-up]"
SHARED = Path(os.environ.get("COURSE_DATA_DIR") or ROOT.parent / "shared" / "data")


def _setup_cells(path: Path) -> list[tuple[int, nbformat.NotebookNode]]:
    nb = nbformat.read(path, as_version=4)
    return [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source.startswith(MARKER)]


def _without_corpora(source: str) -> str:
    return re.sub(r"finish\(corpora=\[.*?\]", "finish(corpora=[...]", source)


def test_every_notebook_carries_the_same_setup_cell_but_for_its_corpora():
    """So that running the cell in a hosted kernel for one notebook proves it for all of them."""
    sources = {path.name: _without_corpora(_setup_cells(path)[0][1].source) for path in NOTEBOOKS}
    first = sources[NOTEBOOKS[0].name]
    assert "finish(corpora=[...]" in first
    assert [name for name, source in sources.items() if source != first] == []


def _as_python(source: str) -> str:
    """The cell as IPython runs it (%pip becomes a call)."""
    from IPython.core.inputtransformer2 import TransformerManager
    return TransformerManager().transform_cell(source)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem[:2] for p in NOTEBOOKS])
def test_each_notebook_opens_with_one_setup_cell_right_after_its_title(path):
    cells = _setup_cells(path)
    assert len(cells) == 1, f"{path.name}: expected one set-up cell (first line {MARKER!r}), found {len(cells)}"
    index, cell = cells[0]
    nb = nbformat.read(path, as_version=4)
    assert index == 1 and nb.cells[0].cell_type == "markdown", f"{path.name}: the set-up cell follows the title"
    assert not any(c.cell_type == "code" for c in nb.cells[:index])
    # What nbval compares it with: the line it prints where the course is installed.
    shown = "".join(o.get("text", "") for o in cell.outputs)
    assert shown == hosted_setup.READY_LINE + "\n"
    compile(_as_python(cell.source), path.name, "exec")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem[:2] for p in NOTEBOOKS])
def test_the_setup_cell_installs_by_name_with_ranges_and_holds_torch(path):
    (_, cell), = _setup_cells(path)
    name = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    assert name == hosted_setup.DISTRIBUTION
    assert f'os.environ.get("{hosted_setup.SOURCE_ENV}", "{name}")' in cell.source
    installs = [line.strip() for line in cell.source.splitlines() if "%pip" in line]
    assert len(installs) == 1 and installs[0].startswith("%pip install")
    assert "==" not in installs[0] and "[pinned]" not in installs[0], "never the exact pins in a hosted kernel"
    assert '-c "{_keep.name}"' in installs[0], "the kernel's torch is held by a constraint"
    assert 'f"torch=={_torch}' in cell.source
    # The corpora it prepares are the ones the notebook reads.
    wanted = re.search(r"finish\(corpora=(\[.*?\])", cell.source).group(1)
    wanted = json.loads(wanted.replace("'", '"'))
    assert set(wanted) <= set(CORPORA)
    text = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells
                     if c.cell_type == "code" and not c.source.startswith(MARKER))
    if re.search(r"load_corpus\(|char_corpus\(|corpus_path\(|prepare_preset\(|[\"']tinyshakespeare[\"']", text):
        assert "tinyshakespeare" in wanted, f"{path.name} reads tinyshakespeare; its set-up cell should prepare it"
    if re.search(r"load_names\(|[\"']names_char[\"']", text):
        assert "names" in wanted, f"{path.name} reads the names corpus; its set-up cell should prepare it"


def _run_cell_here(source: str, env: dict) -> subprocess.CompletedProcess:
    """The cell's Python in a fresh interpreter of this venv (where the course is installed), then what it
    imported: the ready path must import neither torch nor the course (so it takes a moment, not seconds)."""
    code = (_as_python(source).replace("get_ipython()", "(lambda: (_ for _ in ()).throw(AssertionError('no pip')))()")
            + "\nimport sys\nprint('imported:', sorted(m for m in ('torch', 'course_lib') if m in sys.modules))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_where_the_course_is_installed_the_cell_only_checks_and_prints_its_stable_line():
    (_, cell), = _setup_cells(NOTEBOOKS[0])
    done = _run_cell_here(cell.source, dict(os.environ))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [hosted_setup.READY_LINE, "imported: []"]


def test_where_the_course_is_missing_the_cell_installs_it_before_anything_else(tmp_path):
    (_, cell), = _setup_cells(NOTEBOOKS[1])
    # course_lib out of the interpreter's reach (the checkout's editable finder and path removed): the cell
    # reaches %pip, here a stand-in that only prints what it was asked.
    hide = (f"import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
            f"sys.path[:] = [p for p in sys.path if p not in ('', {str(ROOT)!r})]\n")
    code = hide + _as_python(cell.source).replace(
        # IPython expands {names} in a magic's line from the kernel's namespace before running it
        "get_ipython().run_line_magic",
        "(lambda name, line: print('PIP', name, line.format(**globals()), '| KEEP', repr(open(_keep.name).read())))")
    env = dict(os.environ, COURSE_SOURCE="/wheels/attention_course-9.9-py3-none-any.whl")
    env.pop("PYTHONPATH", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                          cwd=tmp_path)
    assert "PIP pip install --quiet -c " in done.stdout, done.stdout + done.stderr
    pip_line, kept = next(line for line in done.stdout.splitlines() if line.startswith("PIP")).split(" | KEEP ")
    assert pip_line.endswith('"/wheels/attention_course-9.9-py3-none-any.whl"'), pip_line
    from importlib import metadata
    assert kept == repr(f"torch=={metadata.version('torch')}\n"), kept   # what pip was held to
    keep = Path(re.search(r'-c "([^"]+)"', pip_line).group(1))
    assert not keep.exists(), f"the set-up cell left its constraints file behind: {keep}"
    # course_lib still missing after the (pretend) install: one clear error naming the source, not an import crash
    assert "RuntimeError: set-up: /wheels/attention_course-9.9-py3-none-any.whl could not be installed" in done.stderr


def test_prepare_corpora_finds_or_says_where_to_put_each(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_DATA_DIR", str(tmp_path))
    monkeypatch.setattr("course_lib.corpora.search_dirs", lambda: [tmp_path])
    assert hosted_setup.prepare_corpora(["names"], download=False) == [
        f"names missing: save it as {tmp_path / 'names.txt'}"]
    if (SHARED / "names.txt").is_file():
        shutil.copy(SHARED / "names.txt", tmp_path / "names.txt")
        assert hosted_setup.prepare_corpora(["names"], download=False) == ["names found"]
    for bad in ("names", ["poems"], [3]):
        with pytest.raises(ValueError, match="names: expected a list of corpus names"):
            hosted_setup.prepare_corpora(bad)


def test_host_and_widgets():
    assert hosted_setup.hosting({}, ["google.colab"]) == "colab"
    assert hosted_setup.hosting({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, []) == "kaggle"
    assert hosted_setup.hosting({}, []) == "local"
    env: dict = {}
    assert hosted_setup.widget_mode("kaggle", env) == "static" and env["COURSE_STATIC_WIDGETS"] == "1"
    assert hosted_setup.widget_mode("kaggle", {"COURSE_STATIC_WIDGETS": "0"}) == "widgets"   # explicit wins
    assert hosted_setup.widget_mode("colab", {}) == "widgets"
    with pytest.raises(ValueError, match="host: expected"):
        hosted_setup.widget_mode("binder", {})


def test_finish_prints_one_line_and_says_when_torch_was_replaced(capsys, monkeypatch):
    monkeypatch.setattr(hosted_setup, "_torch_version", lambda: "2.13.0+cpu")
    monkeypatch.setattr(hosted_setup, "prepare_corpora", lambda names, download=True: [f"{n} found" for n in names])
    line = hosted_setup.finish(["names"], torch_before="2.13.0+cpu", source="wheel.whl")
    assert capsys.readouterr().out == line + "\n" and "\n" not in line
    assert "from wheel.whl, kept torch 2.13.0+cpu; names found" in line
    assert "WARNING: torch 2.9.0+cu126 was replaced by 2.13.0+cpu" in hosted_setup.finish(torch_before="2.9.0+cu126")
    assert "installed torch 2.13.0+cpu" in hosted_setup.finish(torch_before=None)


# --------------------------------------------------------------------------------------------------------
# A kernel without the course, as a hosted one meets the notebook
# --------------------------------------------------------------------------------------------------------

def _torch_fingerprint(python: Path) -> tuple[str, str]:
    """torch's version and the SHA-256 of its RECORD (every installed file and its hash)."""
    code = ("from importlib import metadata; import hashlib; d = metadata.distribution('torch'); "
            "print(d.version, hashlib.sha256(d.read_text('RECORD').encode()).hexdigest(), "
            "len([x for x in metadata.distributions() if x.metadata['Name'] == 'torch']))")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    version, record, count = out.stdout.split()
    assert count == "1", "two torch distributions installed"
    return version, record


def _wheelhouse(base: Path) -> Path:
    """The course's wheel from this checkout, beside its dependencies (kept in build/ between runs,
    one folder per constraints.txt): a stand-in for the package index."""
    pins = hashlib.sha256((ROOT / "constraints.txt").read_bytes()).hexdigest()[:12]
    deps = ROOT / "build" / f"hosted-wheelhouse-{pins}"
    course = base / "index"
    course.mkdir()
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(course), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    wheel = next(course.glob("attention_course-*.whl"))
    if not (deps / ".complete").is_file():
        fetched = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", str(deps), "-c",
                                  str(ROOT / "constraints.txt"), str(wheel)], capture_output=True, text=True,
                                 timeout=1800)
        assert fetched.returncode == 0, fetched.stderr[-3000:]
        (deps / ".complete").touch()
    for dep in deps.glob("*.whl"):
        if not dep.name.startswith(("torch-", "attention_course-")):   # torch is the kernel's own
            os.link(dep, course / dep.name) if dep.stat().st_dev == course.stat().st_dev else shutil.copy(dep, course)
    for dep in deps.glob("*.tar.gz"):
        shutil.copy(dep, course)
    return course


@pytest.fixture(scope="module")
def bare_kernel(tmp_path_factory):
    """A venv with only torch 2.13.0 (CPU) and Jupyter's kernel and runner; no course."""
    base = tmp_path_factory.mktemp("hosted")
    venv = base / "venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "COURSE_"))}
    # PIP_COMPILE=0, here and for the set-up cell's %pip (its kernel inherits this environment): pip byte-compiles
    # none of the thousands of files it installs (torch's, then the course's dependencies'); Python compiles what
    # a notebook imports when it imports it. pip ignores a file that fails to compile anyway: nothing is hidden.
    env["PIP_COMPILE"] = "0"
    assert subprocess.run([sys.executable, "-m", "venv", str(venv)], env=env, timeout=300).returncode == 0
    python = venv / "bin" / "python"
    pins = {line.split("==")[0].lower(): line for line in (ROOT / "constraints.txt").read_text().splitlines()
            if "==" in line}
    kernel = [pins["torch"], pins["ipykernel"], pins["nbconvert"], pins["nbclient"]]
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"), *kernel],
                          env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    missing = subprocess.run([str(python), "-c", "import course_lib"], capture_output=True, env=env, cwd=base)
    assert missing.returncode != 0, "the bare kernel must not have the course"
    return {"python": python, "venv": venv, "base": base, "env": env, "index": _wheelhouse(base)}


def _learner_copy(number: str, base: Path) -> Path:
    """The learner copy of one notebook, alone in an empty folder."""
    copies = base / "copies"
    if not copies.is_dir():
        made = subprocess.run([sys.executable, "-m", "course_lib", "student", str(ROOT / "notebooks"), str(copies)],
                              capture_output=True, text=True, timeout=600)
        assert made.returncode == 0, made.stderr
    source = next(copies.glob(f"{number}_*.ipynb"))
    alone = base / f"alone-{number}"
    alone.mkdir()
    return Path(shutil.copy(source, alone / source.name))


def _uninstall_course(bare_kernel: dict) -> None:
    """Each test meets a kernel without the course (its dependencies may remain from the one before)."""
    subprocess.run([str(bare_kernel["python"]), "-m", "pip", "uninstall", "-y", "-q", hosted_setup.DISTRIBUTION],
                   env=bare_kernel["env"], capture_output=True, timeout=300)


# `make test` runs the notebooks (which record their trainings) before these tests: a whole hosted run of a
# notebook that trains replays what the solutions trained, as the learner copies do (course_lib/train_replay.py;
# any training whose code, data or settings differ runs for real, and so does everything without a record).
TRAIN_RECORD = ROOT / "build" / "train-record"
REPLAY_HOOK = ROOT / "tests" / "train_replay_hook"


# A safety net, not a verdict: longer than nbval's 1,200 s, since a loaded machine without a train record
# (the solutions' pass not run first) trains 05 for real here, and one cell took over 1,200 s so.
CELL_TIMEOUT = 1800


def _run_offline(bare_kernel: dict, notebook: Path, home: Path, corpora: bool) -> nbformat.NotebookNode:
    """``notebook`` run top to bottom in the bare kernel, pip offline with the wheelhouse as its index."""
    home.mkdir()
    env = dict(bare_kernel["env"], HOME=str(home), MPLBACKEND="Agg", COURSE_STATIC_WIDGETS="1", COURSE_THREADS="2",
               PYTHONNOUSERSITE="1", PIP_NO_INDEX="1", PIP_FIND_LINKS=str(bare_kernel["index"]),
               HTTPS_PROXY="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9")   # offline for sure
    if corpora:
        env["COURSE_DATA_DIR"] = str(SHARED)   # the corpora already where the learner was told to put them
    if TRAIN_RECORD.is_dir():
        env.update(PYTHONPATH=str(REPLAY_HOOK), COURSE_TRAIN_REPLAY=str(TRAIN_RECORD))
    ran = subprocess.run([str(bare_kernel["venv"] / "bin" / "jupyter"), "nbconvert", "--to", "notebook", "--execute",
                          f"--ExecutePreprocessor.timeout={CELL_TIMEOUT}", "--output", "ran", notebook.name],
                         cwd=notebook.parent, env=env, capture_output=True, text=True, timeout=3600)
    assert ran.returncode == 0, ran.stderr[-4000:]
    return nbformat.read(notebook.parent / "ran.ipynb", as_version=4)


def _setup_line(ran: nbformat.NotebookNode, torch_version: str, corpora: list[str]) -> None:
    """The set-up cell said, in one line, that it installed the course, kept torch and found the corpora."""
    (_, cell), = [(i, c) for i, c in enumerate(ran.cells) if c.cell_type == "code" and c.source.startswith(MARKER)]
    said = [line for o in cell.outputs if o.get("name") == "stdout" for line in o["text"].splitlines()]
    ours = [line for line in said if line.startswith("set-up:")]
    assert len(ours) == 1, said
    assert ours[0].startswith(f"set-up: installed course_lib {_version()} from {hosted_setup.DISTRIBUTION}, "
                              f"kept torch {torch_version}"), ours[0]
    for corpus in corpora:
        assert f"{corpus} found" in ours[0]
    assert ours[0].endswith("local host, static")


def _imports(path: Path) -> list[str]:
    """The import statements of a notebook's code cells (its set-up cell's aside), as written."""
    import ast
    found = []
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "code" or cell.source.startswith(MARKER):
            continue
        tree = ast.parse(_as_python(cell.source))
        found += [ast.unparse(node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    return found


# The learner copies run whole here. `make test` runs them here only (the Makefile's HOSTED_COPIES, which
# `make learner-copies` then leaves out): one run of each per CI, not two.
# 01 has no corpus, 05 both; a notebook with one runs the same cell with a shorter list (the fast test above), so
# its whole run here took 24 s alone (more beside the other tests) and showed nothing the two do not.
WHOLE = (("01", []), ("05", ["names", "tinyshakespeare"]))
# The marks that change nbval-lax's verdict on a copy (ignoring a cell's output changes nothing there: nbval-lax
# compares only the cells marked for it).
NBVAL_MARKS = ("raises-exception", "check-output", "skip")


def test_the_makefile_leaves_to_this_test_exactly_the_copies_it_runs_whole():
    """Else a copy would run twice in `make test` (listed there, not here) or not at all (the other way)."""
    makefile = (ROOT / "Makefile").read_text()
    listed = re.search(r"^HOSTED_COPIES\s*:?=(.*)$", makefile, re.M)
    assert listed, "Makefile: HOSTED_COPIES := ... (the learner copies test_hosted_setup runs whole) is missing"
    assert listed.group(1).split() == [number for number, _ in WHOLE], "Makefile: HOSTED_COPIES differs from WHOLE"
    assert re.search(r"^test: LEARNER_COPIES_ELSEWHERE\s*:?=\s*\$\(HOSTED_COPIES\)\s*$", makefile, re.M), \
        "Makefile: `make test` should leave HOSTED_COPIES out of learner-copies (test: LEARNER_COPIES_ELSEWHERE := ...)"


def _lax_verdict_is_no_error(copy: Path) -> None:
    """nbval-lax fails a copy on a cell's error, except where a mark allows it, skips the cells marked so and
    compares the outputs of the cells marked for it. With none of those marks, its verdict is exactly "no cell
    raised", which is what an nbconvert run without --allow-errors gives (the ran notebook is searched too)."""
    nb = nbformat.read(copy, as_version=4)
    comments = [f"NBVAL_{mark.replace('-', '_').upper()}" for mark in NBVAL_MARKS]
    tags = {*NBVAL_MARKS, *(f"nbval-{mark}" for mark in NBVAL_MARKS)}
    marked = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (
        any(comment in c.source for comment in comments) or tags & set(c.get("metadata", {}).get("tags", [])))]
    assert marked == [], (f"{copy.name}: cells {marked} carry nbval marks, which this run does not honour; compare "
                          "them here or take the copy out of HOSTED_COPIES so that make learner-copies runs it")


def _no_errors(ran: nbformat.NotebookNode, name: str) -> None:
    errors = [(i, o.get("ename")) for i, c in enumerate(ran.cells) if c.cell_type == "code"
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert errors == [], f"{name}: cells raised {errors}"


def _package_untouched(python: Path) -> list[str]:
    """The installed course's files that are not the ones pip installed (its RECORD): none was added or changed
    by running a notebook (Python's own bytecode cache aside)."""
    code = ("import base64, hashlib; from importlib import metadata; from pathlib import Path\n"
            f"d = metadata.distribution({hosted_setup.DISTRIBUTION!r}); root = Path(d.locate_file(''))\n"
            "recorded = {str(f): f.hash for f in d.files if f.parts[0] == 'course_lib'}\n"
            "package = Path(d.locate_file('course_lib'))\n"
            "for path in sorted(package.rglob('*')):\n"
            "    if not path.is_file() or '__pycache__' in path.parts: continue\n"
            "    name = str(path.relative_to(root))\n"
            "    digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b'=').decode()\n"
            "    if name not in recorded: print('added', name)\n"
            "    elif recorded[name] is None or recorded[name].value != digest: print('changed', name)\n")
    # -I, and a folder of its own: from the checkout, `-c` would find the checkout's own metadata first
    out = subprocess.run([str(python), "-I", "-c", code], capture_output=True, text=True, timeout=300, cwd=python.parent)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def _with_every_notebooks_imports(copy: Path) -> Path:
    """``copy`` with one cell per notebook after its last, holding that notebook's imports as written."""
    nb = nbformat.read(copy, as_version=4)
    for path in NOTEBOOKS:
        imports = _imports(path)
        assert any("course_lib" in line for line in imports), f"{path.name}: no course import found"
        nb.cells.append(nbformat.v4.new_code_cell(f"# {path.name}\n" + "\n".join(imports)))
    nbformat.write(nb, copy)
    return copy


@pytest.mark.slow
def test_in_a_kernel_without_the_course_learner_copies_run_and_every_notebooks_imports_resolve(bare_kernel):
    """One test, so that the bare kernel (a venv with torch) is built once, whichever pytest-xdist worker runs it.

    Learner copies 01 (no corpus) and 05 (both, and it trains), each alone in an empty folder, top to
    bottom, in a kernel without the course, with nbval-lax's verdict on them; 05's kernel then imports what every
    notebook imports (05's set-up cell prepares both corpora, and every notebook's set-up cell is 05's but for
    its corpora: a fast test above). None changes the kernel's torch, and none writes into the installed course."""
    python, base = bare_kernel["python"], bare_kernel["base"]
    torch_before = None
    for number, corpora in WHOLE:
        _uninstall_course(bare_kernel)
        torch_before = torch_before or _torch_fingerprint(python)
        copy = _learner_copy(number, base)
        _lax_verdict_is_no_error(copy)
        if corpora == ["names", "tinyshakespeare"]:
            _with_every_notebooks_imports(copy)
        ran = _run_offline(bare_kernel, copy, base / f"home-{number}", corpora=bool(corpora))
        _no_errors(ran, copy.name)
        assert _torch_fingerprint(python) == torch_before, f"{number}'s set-up cell changed the kernel's torch"
        _setup_line(ran, torch_before[0], corpora)
        assert _package_untouched(python) == [], f"running {copy.name} wrote into the installed course"
    assert any(corpora == ["names", "tinyshakespeare"] for _, corpora in WHOLE), "no run imports every notebook's"


def _version() -> str:
    from course_lib import __version__
    return __version__

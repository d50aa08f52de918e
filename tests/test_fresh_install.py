"""The learner's path without a checkout: README's commands (`pip install "attention-course[pinned]"`), word for
word, in an empty folder and a fresh venv, the package index stood in for by a folder holding the wheel built
from this checkout; then `start`, and a learner copy's first cells in the venv's own kernel, offline.

This is what a JupyterHub room, a hosted notebook or a class venv does: no checkout, no make.
The venv is built once for the module (about a minute: pip takes the dependencies from its cache).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("COURSE_DATA_DIR") or ROOT.parent / "shared" / "data")   # CI: ../shared/data
INSTALL_TIMEOUT = 1200   # seconds; a cold pip cache on a slow mirror is the worst case


def _run(args: list, cwd: Path, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    return done


def _without_course(environ: dict) -> dict:
    """No checkout, venv or course setting leaks in from the environment running the tests."""
    return {k: v for k, v in environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "COURSE_"))}


def _student_env(home: Path) -> dict:
    """The environment of a student who has only the fresh venv, in a home of their own, offline."""
    env = {k: v for k, v in _without_course(dict(os.environ)).items()
           if not k.startswith(("JUPYTER", "XDG_")) and k.lower() not in ("http_proxy", "https_proxy")}
    env.update(HOME=str(home), MPLBACKEND="Agg", COURSE_STATIC_WIDGETS="1", COURSE_THREADS="2",
               PYTHONNOUSERSITE="1",
               # Offline for sure: a download goes to a closed port on this machine and fails at once.
               HTTPS_PROXY="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9")
    return env


def _package_files(folder: Path) -> dict[str, tuple[int, int]]:
    # Python's own bytecode cache is the interpreter's business, not the course's.
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def readme_commands() -> list[str]:
    """README's no-checkout commands: the code block after the comment naming this file."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    marker = readme.index("<!-- tests/test_fresh_install.py")
    block = re.search(r"```\n(.*?)```", readme[marker:], re.S)
    assert block and block.start() < readme.index("\n\n", marker) + 3, "README: the marked code block is missing"
    return [line for line in block.group(1).splitlines() if line.strip()]


DISTRIBUTION = "attention-course"   # pyproject.toml's [project] name


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory):
    """An empty folder, a fresh venv activated, and README's commands, word for word; the wheel built from
    this checkout is the package index's `attention-course` (and nothing newer of that name can be taken)."""
    base = tmp_path_factory.mktemp("fresh")
    wheels, venv, home, folder = base / "wheels", base / "venv", base / "home", base / "no-checkout"
    home.mkdir()
    folder.mkdir()
    env = _without_course(dict(os.environ))   # pip keeps its own cache and configuration
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, ROOT],
                 cwd=base, env=env)
    assert built.returncode == 0, built.stdout + built.stderr
    wheel = next(wheels.glob(DISTRIBUTION.replace("-", "_") + "-*.whl"))
    version = wheel.name.split("-")[1]
    commands = readme_commands()
    assert commands[0] == f'pip install "{DISTRIBUTION}[pinned]"', \
        f"README's no-checkout block should start with: pip install \"{DISTRIBUTION}[pinned]\" (got {commands[0]!r})"
    only_this = base / "only-this-course.txt"
    only_this.write_text(f"{DISTRIBUTION}=={version}\n")
    env = dict(env, PIP_FIND_LINKS=" ".join(filter(None, [str(wheels), os.environ.get("PIP_FIND_LINKS")])),
               PIP_CONSTRAINT=" ".join(filter(None, [str(only_this), os.environ.get("PIP_CONSTRAINT")])))
    made = _run([sys.executable, "-m", "venv", venv], cwd=base, env=env)
    assert made.returncode == 0, made.stderr
    # README's lines as a student types them, in the activated venv, one failure stopping the rest.
    script = "set -e\n. " + shlex.quote(str(venv / "bin" / "activate")) + "\n" + "\n".join(commands) + "\n"
    # PIP_COMPILE=0: pip byte-compiles none of the ~13,000 installed .py files (the set-up took 34 s of CPU less); Python
    # compiles what is imported when it is imported. pip ignores a file that fails to compile anyway, so
    # this hides nothing the test could see.
    ran = _run(["bash", "-c", script], cwd=folder, env=dict(env, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_COMPILE="0"),
               timeout=INSTALL_TIMEOUT)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    python = venv / "bin" / "python"
    package = Path(_run([python, "-c", "import course_lib, os; print(os.path.dirname(course_lib.__file__))"],
                        cwd=base, env=env).stdout.strip())
    assert package.parent.name == "site-packages", f"course_lib imported from {package}, not the fresh venv"
    return {"python": python, "venv": venv, "home": home, "env": _student_env(home), "package": package,
            "base": base, "folder": folder, "readme_output": ran.stdout}


def test_readme_commands_install_the_tested_versions_and_write_the_copies(fresh_venv):
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    listed = _run([fresh_venv["python"], "-m", "pip", "list", "--format=json"], cwd=fresh_venv["base"],
                  env=fresh_venv["env"])
    installed = {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(listed.stdout)}
    for name in ("torch", "transformers", "jupyterlab", "ipywidgets", "numpy", "matplotlib", "tokenizers"):
        wanted = next(v for k, v in pins.items() if k.lower().replace("_", "-") == name)
        assert installed[name].split("+")[0] == wanted, f"{name}: {installed[name]} installed, {wanted} tested"
    copies = sorted(p.name for p in (fresh_venv["folder"] / "attention-course").glob("*.ipynb"))
    assert copies == sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert "jupyter lab attention-course/01_attention_toy.ipynb" in fresh_venv["readme_output"]
    assert sorted(p.name for p in fresh_venv["folder"].iterdir())[0] == "attention-course"


def test_start_writes_the_learner_copies_from_the_installed_package(fresh_venv):
    work = fresh_venv["base"] / "start-here"
    work.mkdir()
    done = _run([fresh_venv["python"], "-m", "course_lib", "start"], cwd=work, env=fresh_venv["env"])
    assert done.returncode == 0, done.stderr
    copies = sorted(p.name for p in (work / "attention-course").glob("*.ipynb"))
    shipped = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert copies == shipped
    assert "jupyter lab attention-course/01_attention_toy.ipynb" in done.stdout
    again = _run([fresh_venv["python"], "-m", "course_lib", "start"], cwd=work, env=fresh_venv["env"])
    assert again.stdout.count("up to date") == len(shipped)


def _execute(fresh_venv: dict, notebook: Path, env: dict, *options: str) -> subprocess.CompletedProcess:
    """nbconvert from the notebook's own folder, naming no kernel: the notebook's python3 is used."""
    jupyter = fresh_venv["venv"] / "bin" / "jupyter"
    return _run([jupyter, "nbconvert", "--to", "notebook", "--execute", *options,
                 "--output", f"{notebook.stem}.ran", notebook.name], cwd=notebook.parent, env=env)


# A cell that reads a corpus (as tests/test_hosted_setup.py finds one).
READS_A_CORPUS = re.compile(r"load_corpus\(|char_corpus\(|corpus_path\(|prepare_preset\(|load_names\(")


def _up_to_the_first_corpus(copy: Path, out: Path) -> int:
    """``copy``'s cells up to and including the first that reads a corpus, written to ``out``; that cell's index."""
    nb = json.loads(copy.read_text(encoding="utf-8"))
    first = next(i for i, c in enumerate(nb["cells"])
                 if c["cell_type"] == "code" and READS_A_CORPUS.search("".join(c["source"])))
    nb["cells"] = nb["cells"][:first + 1]
    out.write_text(json.dumps(nb), encoding="utf-8")
    return first


def _cells(path: Path) -> list[tuple[str, str]]:
    return [(c["cell_type"], "".join(c["source"])) for c in json.loads(path.read_text(encoding="utf-8"))["cells"]]


def test_learner_copies_run_in_the_fresh_venv_and_nothing_is_written_into_the_package(fresh_venv, tmp_path):
    package_before = _package_files(fresh_venv["package"])
    work = fresh_venv["base"] / "class"
    work.mkdir()
    assert _run([fresh_venv["python"], "-m", "course_lib", "start", "mine"], cwd=work,
                env=fresh_venv["env"]).returncode == 0
    copies = work / "mine"

    # Every copy `start` writes from the installed package is, cell for cell, the copy the checkout makes: the
    # copies that `make learner-copies` runs whole, and 01 and 05 that tests/test_hosted_setup.py runs whole
    # with the course installed from the same wheel, in the same versions. So none runs whole again here.
    from course_lib.classroom.assignments import update_learner_copies
    update_learner_copies(ROOT / "notebooks", tmp_path / "checkout")
    for made in sorted((tmp_path / "checkout").glob("*.ipynb")):
        assert _cells(copies / made.name) == _cells(made), f"start's {made.name} is not the checkout's learner copy"

    # In this venv's own kernel (the copy's python3), offline with no corpus anywhere: 02's cells up to the first
    # that reads a corpus run, and that cell shows one clear message naming the per-user folder, not a traceback.
    first = _up_to_the_first_corpus(copies / "02_masked_attention.ipynb", copies / "02_first_cells.ipynb")
    offline = _execute(fresh_venv, copies / "02_first_cells.ipynb", fresh_venv["env"], "--allow-errors")
    assert offline.returncode == 0, offline.stderr[-3000:]
    ran = json.loads((copies / "02_first_cells.ran.ipynb").read_text(encoding="utf-8"))
    errors = [(i, o) for i, c in enumerate(ran["cells"]) if c["cell_type"] == "code" for o in c["outputs"]
              if o["output_type"] == "error"]
    assert [(i, o["ename"]) for i, o in errors] == [(first, "CorpusError")]
    shown = "\n".join(errors[0][1]["traceback"])
    user_folder = fresh_venv["home"] / ".cache" / "attention-course"
    assert shown.startswith("CorpusError: Corpus 'tinyshakespeare'")
    assert f"save it as {user_folder / 'tinyshakespeare.txt'}" in shown
    assert "Traceback" not in shown and 'File "' not in shown and "site-packages" not in shown
    assert not user_folder.exists(), "a failed download leaves no folder behind"

    doctor = _run([fresh_venv["python"], "-m", "course_lib", "doctor"], cwd=work, env=fresh_venv["env"])
    assert f"1. {user_folder}  (per-user folder" in doctor.stdout
    assert "site-packages" not in doctor.stdout.split("corpora are looked for in")[1]
    assert _package_files(fresh_venv["package"]) == package_before, "something wrote into site-packages/course_lib"
    assert not (fresh_venv["package"].parent / "data").exists()

"""The set-up files agree with each other, so every way in installs the same course."""
import re
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:   # Python 3.10: pip carries the same parser
    from pip._vendor import tomli as tomllib

import yaml
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]
CONDA_NAMES = {"pytorch": "torch", "python-build": "build"}   # conda-forge package name -> PyPI name


def requirement_map(lines):
    found = {}
    for line in lines:
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*(.*)", line.strip())
        assert match, f"cannot parse requirement {line!r}"
        name = match.group(1).lower()
        found[CONDA_NAMES.get(name, name)] = match.group(2).replace(" ", "")
    return found


def pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_environment_yml_lists_the_same_dependencies_as_pyproject():
    project = pyproject()["project"]
    wanted = requirement_map(project["dependencies"] + project["optional-dependencies"]["test"])
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = [d for d in env["dependencies"] if isinstance(d, str) and re.split(r"[<>=! ]", d)[0] not in ("python", "pip")]
    assert requirement_map(conda) == wanted
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert "-c constraints.txt" in pip_section and any(line.startswith("-e") for line in pip_section)
    python = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python"))
    assert python.replace("python", "") == pyproject()["project"]["requires-python"]


def test_constraints_pin_every_dependency_exactly_inside_the_pyproject_range():
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pins[name.lower().replace("_", "-")] = version
    project = pyproject()["project"]
    extras = [line for lines in project["optional-dependencies"].values() for line in lines]
    for requirement, spec in requirement_map(project["dependencies"] + extras).items():
        pinned = pins.get(requirement.replace("_", "-"))
        assert pinned, f"{requirement} has no exact version in constraints.txt"
        assert SpecifierSet(spec).contains(pinned, prereleases=True), \
            f"constraints.txt pins {requirement}=={pinned}, outside pyproject's range {spec!r}"


def test_nbgrader_comes_only_with_the_instructor_extra():
    project = pyproject()["project"]
    assert "nbgrader" in requirement_map(project["optional-dependencies"]["instructor"])
    assert "nbgrader" not in requirement_map(project["dependencies"] + project["optional-dependencies"]["test"])
    makefile = (ROOT / "Makefile").read_text()
    # CI's `make test` runs tests/test_nbgrader.py with it: the instructor venv installs the extra
    assert re.search(r'-e "\.\[\$\(EXTRAS\),instructor\]"', makefile)
    assert re.search(r"^EXTRAS := test\b", makefile, re.MULTILINE), "the extras start with the test extra"


def test_triton_is_installed_only_where_it_ships_wheels():
    project = pyproject()["project"]
    assert "triton" in requirement_map(project["optional-dependencies"]["triton"])
    assert "triton" not in requirement_map(project["dependencies"] + project["optional-dependencies"]["test"])
    makefile = (ROOT / "Makefile").read_text()
    assert "Linux-x86_64" in makefile and "triton" in makefile.split("EXTRAS :=", 1)[1].splitlines()[0]


def test_every_course_lib_package_is_listed_for_setuptools():
    # pyproject lists packages explicitly; a subpackage missing there is missing from the wheel
    listed = set(pyproject()["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "course_lib").rglob("__init__.py")}
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml"


def test_ci_runs_make_test_with_the_shared_corpora():
    script = (ROOT / ".ci" / "run").read_text()
    assert "make test" in script
    assert "COURSE_DATA_DIR" in script and "shared/data" in script


def test_readme_opens_with_the_two_setup_commands():
    text = (ROOT / "README.md").read_text()
    first_code = re.search(r"```(?:\w+)?\n(.*?)```", text, re.S).group(1)
    assert first_code.split() == ["make", "lab"] or first_code.strip().splitlines()[:2] == ["make lab", "make test"]
    assert text.index("make lab") < text.index("make test") < text.index("##", text.index("make test"))


def test_corpora_are_never_committed():
    ignored = (ROOT / ".gitignore").read_text()
    assert "/data/*.txt" in ignored


def _make_dry_run(target: str) -> str:
    import subprocess
    done = subprocess.run(["make", "-n", "-B", target], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_make_lab_opens_the_students_own_copy_and_never_the_solutions():
    steps = _make_dry_run("lab")
    assert "-m course_lib start student" in steps, "make lab writes the learner copies (keeping edits)"
    opening = [line for line in steps.splitlines() if "jupyter lab" in line]
    assert len(opening) == 1 and opening[0].startswith("cd student && ") \
        and opening[0].endswith(" 01_attention_toy.ipynb"), opening
    assert "notebooks/" not in opening[0]
    assert "notebooks/01_attention_toy.ipynb" in _make_dry_run("lab-solutions")
    assert "data --warn-only" in steps, "offline without corpora, make lab still opens"


def test_nothing_in_the_makefile_deletes_the_students_work():
    assert "/student/" in (ROOT / ".gitignore").read_text().split()
    for target in ("clean", "test", "lab", "student"):
        for command in re.split(r"&&|;|\n", _make_dry_run(target)):
            words = command.split()
            if words[:1] == ["rm"]:
                assert not {"student", "student/", "./student"} & set(words), f"make {target}: {command}"


def test_the_transformers_range_stated_in_hf_is_pyprojects():
    from course_lib.hf import TRANSFORMERS_REQUIREMENT
    wanted = requirement_map(pyproject()["project"]["dependencies"])["transformers"]
    assert TRANSFORMERS_REQUIREMENT == wanted, (f"course_lib/hf says transformers{TRANSFORMERS_REQUIREMENT}, "
                                                f"pyproject.toml says transformers{wanted}")


# --------------------------------------------------------------------------------------------------------
# The release: one name, one version, the sdist and the wheel as `python -m build` makes them
# --------------------------------------------------------------------------------------------------------

def _version() -> str:
    return re.search(r'^__version__ = "([^"]+)"', (ROOT / "course_lib" / "runtime.py").read_text(), re.M).group(1)


def test_the_version_lives_in_one_place_and_the_changelog_has_its_section():
    project = pyproject()["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert pyproject()["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "course_lib.runtime.__version__"}
    others = [p for p in ROOT.rglob("*.py") if ".venv" not in p.parts and "build" not in p.parts
              and re.search(r'^__version__ = "', p.read_text(encoding="utf-8", errors="replace"), re.M)]
    assert others == [ROOT / "course_lib" / "runtime.py"], others
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog and f"## [{_version()}]" in changelog


def test_the_distribution_name_says_what_the_course_is_and_the_import_name_stays():
    project = pyproject()["project"]
    assert project["name"] == "attention-course"
    assert all(p == "course_lib" or p.startswith("course_lib.") for p in pyproject()["tool"]["setuptools"]["packages"])
    from course_lib.classroom.grading.autograder import DISTRIBUTION as graded
    from course_lib.hosted_setup import DISTRIBUTION as hosted
    assert hosted == graded == project["name"]


@pytest.mark.slow
def test_python_m_build_makes_the_sdist_and_the_wheel_with_the_whole_course(tmp_path):
    import subprocess
    import sys
    import tarfile
    import zipfile
    # As the release workflow builds them (there in an isolated build env; here with this venv's setuptools,
    # the build being offline).
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir",
                            str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    version = _version()
    wheel, sdist = tmp_path / f"attention_course-{version}-py3-none-any.whl", tmp_path / f"attention_course-{version}.tar.gz"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([wheel.name, sdist.name])
    notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(f"attention_course-{version}.dist-info/METADATA").decode()
    assert sorted(n.rsplit("/", 1)[1] for n in names if n.startswith("course_lib/notebooks/")) == notebooks
    assert "course_lib/hosted_setup.py" in names and "course_lib/classroom/grading/autograder.py" in names
    assert not [n for n in names if n.endswith(".txt") and "data" in n], "corpora never ship"
    assert "Name: attention-course\n" in meta and f"Version: {version}\n" in meta
    requires = {line.split(" ", 1)[1] for line in meta.splitlines() if line.startswith("Requires-Dist: ")}
    assert "torch>=2.13" in requires and not [r for r in requires if "==" in r and "extra ==" not in r], \
        "the plain install declares ranges; exact pins only in the pinned extra"
    with tarfile.open(sdist) as t:
        members = {m.name.split("/", 1)[1] for m in t.getmembers() if "/" in m.name}
    assert {"pyproject.toml", "README.md", "course_lib/runtime.py"} <= members
    assert {f"notebooks/{n}" for n in notebooks} <= members, "the sdist builds the same wheel"


# --------------------------------------------------------------------------------------------------------
# make setup: uv where it is, pip otherwise; torch's CPU build on Linux without an NVIDIA GPU
# --------------------------------------------------------------------------------------------------------

def _install_steps(tmp_path, *, uv: bool, nvidia: bool, **variables) -> list[str]:
    """The commands `make setup` would run with only these tools on PATH (dry run: nothing installed)."""
    import os
    import shutil
    import subprocess
    tools = tmp_path / ("uv" if uv else "pip") / ("gpu" if nvidia else "cpu")
    tools.mkdir(parents=True)
    for name in ("sh", "id", "python3"):
        (tools / name).symlink_to(shutil.which(name))
    # A Linux x86-64 machine, wherever the test runs
    (tools / "uname").write_text('#!/bin/sh\n[ "$1" = -m ] && echo x86_64 || echo Linux\n')
    (tools / "uname").chmod(0o755)
    for fake, wanted in (("uv", uv), ("nvidia-smi", nvidia)):
        if wanted:
            (tools / fake).write_text("#!/bin/sh\nexit 0\n")
            (tools / fake).chmod(0o755)
    make = shutil.which("make")
    args = [make, "-n", "-B", ".venv/.installed"] + [f"{k}={v}" for k, v in variables.items()]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PATH=str(tools)))
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if line.strip()]


def test_make_setup_uses_uv_when_it_is_on_path_with_the_same_exact_versions(tmp_path):
    steps = _install_steps(tmp_path, uv=True, nvidia=False)
    installs = [s for s in steps if "/uv pip install" in s]
    assert len(installs) == 1 and "/uv pip install --python .venv/bin/python" in installs[0]
    assert "-c constraints.txt" in installs[0] and '-e ".[test' in installs[0]
    assert "--torch-backend=cpu" in installs[0]
    assert any("/uv venv --seed" in s for s in steps), "the venv keeps pip, for the targets that use it"


def test_make_setup_falls_back_to_pip_and_asks_the_cpu_index_for_torch_alone(tmp_path):
    steps = _install_steps(tmp_path, uv=False, nvidia=False)
    installs = [step.strip() for s in steps if " pip install " in s for step in s.split(" && ")]
    assert len(installs) == 2 and all(s.startswith(".venv/bin/python -m pip install") for s in installs)
    torch_step, course_step = installs
    assert torch_step.endswith(" torch") and "--no-deps" in torch_step and "-c constraints.txt" in torch_step
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in torch_step
    assert "download.pytorch.org" not in course_step and "-c constraints.txt" in course_step
    assert any(s.startswith("test -x .venv/bin/python || python3 -m venv .venv") for s in steps)


def test_make_setup_installs_with_pip_when_uv_fails(tmp_path):
    """uv cannot reach an index (PyTorch's CPU one behind a firewall): the set-up goes on with pip, same pins."""
    import os
    import shutil
    import subprocess
    project = tmp_path / "course"
    project.mkdir()
    for name in ("Makefile", "pyproject.toml", "constraints.txt"):
        shutil.copy(ROOT / name, project / name)
    log = tmp_path / "calls.log"
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in ("sh", "id", "python3", "test", "touch", "echo"):
        if shutil.which(name):
            (tools / name).symlink_to(shutil.which(name))
    (tools / "uname").write_text('#!/bin/sh\n[ "$1" = -m ] && echo x86_64 || echo Linux\n')
    (tools / "uv").write_text(f'#!/bin/sh\necho "uv $*" >> {log}\necho "error: dns error" >&2\nexit 2\n')
    venv_python = project / ".venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    # The venv's python only records what it is asked to install.
    venv_python.write_text(f'#!/bin/sh\necho "python $*" >> {log}\n')
    for script in (tools / "uname", tools / "uv", venv_python):
        script.chmod(0o755)
    done = subprocess.run([shutil.which("make"), ".venv/.installed"], cwd=project, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, PATH=str(tools)))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "installing the same versions with pip" in done.stdout
    calls = log.read_text().splitlines()
    assert calls[0].startswith("uv pip install"), calls
    pip_calls = [c for c in calls[1:] if c.startswith("python -m pip install")]
    assert len(pip_calls) == 2 and all("-c constraints.txt" in c for c in pip_calls), calls
    assert pip_calls[0].endswith(" torch") and "download.pytorch.org/whl/cpu" in pip_calls[0]
    assert (project / ".venv" / ".installed").exists()


def test_make_setup_leaves_torch_to_the_index_where_an_nvidia_gpu_is(tmp_path):
    for uv in (True, False):
        steps = "\n".join(_install_steps(tmp_path / str(uv), uv=uv, nvidia=True))
        assert "download.pytorch.org" not in steps and "--torch-backend" not in steps
        assert "-c constraints.txt" in steps
    forced_pip = "\n".join(_install_steps(tmp_path / "forced", uv=True, nvidia=False, UV=""))
    assert "uv " not in forced_pip and "download.pytorch.org/whl/cpu" in forced_pip

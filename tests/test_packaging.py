"""The set-up files agree with each other, so every way in installs the same course."""
import re
from pathlib import Path

try:
    import tomllib
except ImportError:   # Python 3.10: pip carries the same parser
    from pip._vendor import tomli as tomllib

import yaml
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]
CONDA_NAMES = {"pytorch": "torch"}   # conda-forge package name -> PyPI name


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
    conda = [d for d in env["dependencies"] if isinstance(d, str) and not d.startswith(("python", "pip"))]
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

"""The wheel alone carries the tested versions: pyproject's `pinned` extra is constraints.txt's exact pins
of everything the course needs at run time (its dependencies and theirs, not the test or instructor tools).

After changing constraints.txt, regenerate the extra with `python tests/test_pinned_extra.py --write`.
"""
from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ImportError:   # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
# A venv brings its own; pinning them would fight the installer (torch names setuptools).
INSTALLER_TOOLS = {"pip", "setuptools", "wheel"}


def constraints() -> dict[str, str]:
    """Canonical name -> 'Name==version' as constraints.txt writes it."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, _ = line.partition("==")
            pins[canonicalize_name(name)] = line
    return pins


def runtime_closure() -> set[str]:
    """Every distribution the course's own dependencies pull in here (this environment's metadata),
    their extras followed (jupyter-events needs jsonschema[format-nongpl])."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    todo = [(Requirement(r), "") for r in project["dependencies"]]
    seen: set[tuple[str, str]] = set()
    while todo:
        requirement, parent_extra = todo.pop()
        if requirement.marker and not requirement.marker.evaluate({"extra": parent_extra}):
            continue
        name = canonicalize_name(requirement.name)
        for extra in ["", *sorted(requirement.extras)]:
            if (name, extra) not in seen:
                seen.add((name, extra))
                todo += [(Requirement(r), extra) for r in (metadata.requires(name) or [])]
    return {name for name, _ in seen}


def expected_extra() -> list[str]:
    pins = constraints()
    needed = runtime_closure()
    unpinned = sorted(needed - set(pins) - INSTALLER_TOOLS)
    assert not unpinned, f"needed at run time but not pinned in constraints.txt: {unpinned}"
    return sorted((pins[name] for name in needed - INSTALLER_TOOLS), key=str.lower)


def test_the_pinned_extra_is_constraints_txt_for_everything_the_course_needs_at_run_time():
    declared = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]["pinned"]
    expected = expected_extra()
    assert declared == expected, (
        "pyproject.toml's `pinned` extra differs from constraints.txt; run `python tests/test_pinned_extra.py "
        f"--write`. Only declared: {sorted(set(declared) - set(expected))}; only expected: "
        f"{sorted(set(expected) - set(declared))}")
    # the course itself and the tools students never need stay out
    names = {canonicalize_name(p.split("==")[0]) for p in declared}
    assert {"torch", "transformers", "jupyterlab", "ipywidgets"} <= names
    assert not names & {"pytest", "ruff", "nbgrader", "selenium", "nbval"}


def write() -> None:
    block = "pinned = [\n" + "".join(f'    "{pin}",\n' for pin in expected_extra()) + "]"
    text = PYPROJECT.read_text()
    text, count = re.subn(r"(?ms)^pinned = \[\n.*?^\]", lambda _: block, text)
    assert count == 1, "pyproject.toml: no `pinned = [...]` block under [project.optional-dependencies]"
    PYPROJECT.write_text(text)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write()
    else:
        print("\n".join(expected_extra()))

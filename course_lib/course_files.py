"""Where the course's own files are: the solution notebooks (and, shipped beside them, the data README).

They ship inside the package (``course_lib/notebooks/``, ``course_lib/data_notes/README.md`` in a
wheel), so ``pip install`` alone carries the whole course. In a checkout they are read from
the repository's ``notebooks/`` and ``data/`` folders, the copies the authors edit.
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["KERNEL_NAME", "PACKAGE_DIR", "CHECKOUT_DIR", "running_from_checkout", "notebooks_dir", "course_notebooks"]

# The kernel every notebook names: the one each Jupyter has, so the notebooks run in any Jupyter
# (`make lab` starts JupyterLab from the course's venv, whose python3 kernel is that venv's Python).
KERNEL_NAME = "python3"

PACKAGE_DIR = Path(__file__).resolve().parent
# The repository root when course_lib is imported from a checkout (an editable install, or PYTHONPATH).
CHECKOUT_DIR = PACKAGE_DIR.parent


def running_from_checkout() -> bool:
    """True when course_lib is imported from a git checkout of the course, not from site-packages."""
    return (CHECKOUT_DIR / "pyproject.toml").is_file() and (CHECKOUT_DIR / "notebooks").is_dir()


def _notebooks_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("[0-9][0-9]_*.ipynb") if p.is_file())


def notebooks_dir() -> Path:
    """The folder of the solution notebooks: the checkout's ``notebooks/``, else the shipped copy."""
    candidates = ([CHECKOUT_DIR / "notebooks"] if running_from_checkout() else []) + [PACKAGE_DIR / "notebooks"]
    for folder in candidates:
        if _notebooks_in(folder):
            return folder
    raise FileNotFoundError(f"the course notebooks: expected them in {' or '.join(str(c) for c in candidates)}, "
                            f"found none; reinstall the course with `pip install .` from its repository")


def course_notebooks() -> list[Path]:
    """The solution notebooks, in teaching order (``01_...`` first)."""
    return _notebooks_in(notebooks_dir())

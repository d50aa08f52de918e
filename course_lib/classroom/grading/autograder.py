"""Gradescope's autograder archive, and what it runs for each submission.

``python -m course_lib autograder OUT.zip [--exercises IDS]`` (:func:`write_autograder`) writes the archive
Gradescope asks for: ``setup.sh`` (a venv with the course and its exact tested versions, torch's CPU build
and no CUDA package), ``run_autograder`` (:func:`run_autograder`: grades ``/autograder/submission`` into
``/autograder/results/results.json``, in Gradescope's format, ``gradescope.py``), ``autograder.json`` (the
exercises and limits) and, from a checkout, the course's wheel. Gradescope's default container has 768 MB,
half a CPU and 10 minutes; the limits below keep a whole course's grading inside them.
``AUTOGRADER_ROOT`` moves ``/autograder`` (for testing the archive elsewhere).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any

from .cli import MEMORY_FLOOR_MB, exercise_ids, number

__all__ = ["write_autograder", "run_autograder", "failed_results", "main", "CONTAINER_LINE",
           "DISTRIBUTION", "TIMEOUT", "MEMORY_MB"]

DISTRIBUTION = "attention-course"   # pyproject.toml's [project] name
# Per notebook, its exercises together: eleven notebooks of a hostile submission stay under Gradescope's
# 10 minutes (11 x 40 s), with the self-check and the start-up beside them.
TIMEOUT = 40.0
# Per exercise, address space beyond what the course maps: 256 was too little for notebook 05 graded alone (its
# training step's oneDNN kernels; 320 was enough for every notebook alone and all together, 2026-11-29), and the
# self-check grades the course's solutions under this limit before any student.
MEMORY_MB = 384
CONTAINER_LINE = ("isolation: bubblewrap cannot run in this container, so Gradescope's container, one per "
                  "submission, is the isolation")


def failed_results(message: str) -> dict[str, Any]:
    """A results.json that gives no score and says why (Gradescope shows ``output`` to the student)."""
    return {"score": 0.0, "output": message, "visibility": "visible", "stdout_visibility": "visible", "tests": []}


# ---------------------------------------------------------------------------------------------------------
# The archive
# ---------------------------------------------------------------------------------------------------------

SETUP_SH = r"""#!/usr/bin/env bash
# Gradescope runs this once, when it builds the autograder's image (Ubuntu 22.04 base image).
# A venv in $ROOT/venv with the course and the exact versions it is tested with; torch is the CPU build,
# so no CUDA package is installed. AUTOGRADER_ROOT moves /autograder (for testing elsewhere).
set -euo pipefail
ROOT="${{AUTOGRADER_ROOT:-/autograder}}"
SOURCE="$ROOT/source"
PYTHON="${{AUTOGRADER_PYTHON:-python3.11}}"
if ! command -v "$PYTHON" >/dev/null 2>&1 || ! "$PYTHON" -c "import ensurepip, venv" 2>/dev/null; then
    apt-get update -q && apt-get install -y -q --no-install-recommends python3.11 python3.11-venv
fi
"$PYTHON" -m venv "$ROOT/venv"
pip_install() {{ "$ROOT/venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@"; }}
# torch alone first, from PyTorch's CPU index (PyPI's Linux torch is the CUDA build, gigabytes)
pip_install --no-deps --retries 1 --extra-index-url https://download.pytorch.org/whl/cpu "{torch}"
# then the course with its pinned extra: the exact tested versions (torch already satisfied)
pip_install "{course}"
if "$ROOT/venv/bin/python" -m pip list --format=freeze | grep -i '^nvidia-'; then
    echo "setup.sh: CUDA packages were installed; expected torch's CPU build only" >&2
    exit 1
fi
# The corpora, for the exercises that read them (a warning, not a failure, when offline)
COURSE_DATA_DIR="$ROOT/data" "$ROOT/venv/bin/python" -m course_lib data --warn-only
"""

RUN_AUTOGRADER = r"""#!/usr/bin/env bash
# Gradescope runs this once per submission: grades $ROOT/submission into $ROOT/results/results.json.
ROOT="${AUTOGRADER_ROOT:-/autograder}"
export COURSE_DATA_DIR="$ROOT/data" MPLBACKEND=Agg OMP_NUM_THREADS=1
exec "$ROOT/venv/bin/python" -m course_lib.classroom.grading.autograder "$ROOT"
"""


def _pinned_torch() -> str:
    """torch's exact tested version, as the package's pinned extra declares it."""
    for requirement in metadata.requires(DISTRIBUTION) or []:
        name, _, rest = requirement.partition("==")
        if name.strip() == "torch" and 'extra == "pinned"' in rest:
            return "torch==" + rest.split(";")[0].strip()
    raise RuntimeError(f"{DISTRIBUTION}: its metadata has no pinned torch; reinstall the course "
                       f"(pip install -e . in a checkout)")


def _course_wheel(folder: Path) -> Path | None:
    """From a checkout, the course's wheel built now; installed from the index, None (setup.sh names it)."""
    from ...course_files import CHECKOUT_DIR, running_from_checkout
    if not running_from_checkout():
        return None
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                            "-w", str(folder), str(CHECKOUT_DIR)], capture_output=True, text=True)
    if built.returncode != 0:
        raise RuntimeError(f"the course's wheel could not be built from {CHECKOUT_DIR}: {built.stderr.strip()}")
    return next(folder.glob(DISTRIBUTION.replace("-", "_") + "-*.whl"))


def write_autograder(out: str | os.PathLike, exercises: list[str] | None = None, *, timeout: float = TIMEOUT,
                     memory_mb: int = MEMORY_MB) -> list[str]:
    """Write Gradescope's autograder archive to ``out`` (a .zip); returns the names it holds.

    ``exercises``: ids to grade (None: each submission on the exercises of the notebooks it holds)."""
    from ... import _validate as validate
    from ...runtime import __version__
    from .plan import grading_plan
    target = validate.path("out", out, "the archive to write, e.g. autograder.zip")
    if target.suffix != ".zip":
        raise ValueError(f"out: expected a file name ending in .zip (Gradescope's upload), got '{target}'")
    if not target.parent.is_dir():
        raise FileNotFoundError(f"out: expected an existing folder for '{target.name}', got '{target.parent}'")
    timeout = validate.positive_float("timeout", timeout)
    if validate.positive_int("memory_mb", memory_mb) < MEMORY_FLOOR_MB:   # as `grade --memory-mb` refuses it
        raise ValueError(f"memory_mb: expected megabytes, {MEMORY_FLOOR_MB} or more (less than the course's own "
                         f"solutions need), got {memory_mb}")
    if exercises is not None:
        exercises = list(grading_plan(exercises))   # refuses unknown ids, with the known ones
    torch = _pinned_torch()
    with tempfile.TemporaryDirectory() as tmp:
        wheel = _course_wheel(Path(tmp))
        course = (f"$SOURCE/{wheel.name}[pinned]" if wheel else f"{DISTRIBUTION}[pinned]=={__version__}")
        config = {"course": __version__, "exercises": exercises, "timeout": timeout, "memory_mb": memory_mb}
        files = {"setup.sh": SETUP_SH.format(torch=torch, course=course), "run_autograder": RUN_AUTOGRADER,
                 "autograder.json": json.dumps(config, indent=1) + "\n"}
        partial = target.with_name(target.name + ".partial")   # a finished archive or none, never half of one
        try:
            with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as archive:
                for name, text in files.items():
                    info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
                    info.external_attr = (0o755 if name != "autograder.json" else 0o644) << 16   # Gradescope runs them
                    info.compress_type = zipfile.ZIP_DEFLATED
                    archive.writestr(info, text)
                if wheel:
                    archive.write(wheel, wheel.name)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
        return list(files) + ([wheel.name] if wheel else [])


# ---------------------------------------------------------------------------------------------------------
# One submission, on Gradescope
# ---------------------------------------------------------------------------------------------------------

def _write_results(results: Path, content: dict[str, Any]) -> None:
    from ..._atomic import atomic_file
    with atomic_file(results / "results.json") as handle:
        handle.write(json.dumps(content, indent=1) + "\n")


def run_autograder(root: str | os.PathLike) -> dict[str, Any]:
    """Grade ``root``/submission into ``root``/results/results.json with ``root``/source/autograder.json's
    exercises and limits; a submission that cannot be graded gets a results.json that says why."""
    from ... import _validate as validate
    from . import grade, isolation
    root = validate.path("root", root, "Gradescope's /autograder folder")
    # a missing root or a file is no Gradescope layout: refused, never a results/ made up beside it
    if not root.is_dir():
        raise NotADirectoryError(f"root: expected Gradescope's /autograder folder (holding source/ and "
                                 f"submission/), got '{root}' ({'a file' if root.exists() else 'missing'})")
    results = root / "results"
    results.mkdir(parents=True, exist_ok=True)
    try:
        config = json.loads((root / "source" / "autograder.json").read_text(encoding="utf-8"))
        config = {key: config[key] for key in ("timeout", "memory_mb", "exercises")}
    except (OSError, ValueError, KeyError, TypeError) as exc:   # a results.json still: else "no output"
        content = failed_results(f"This submission could not be graded: the autograder itself is broken (its "
                                 f"source/autograder.json: {type(exc).__name__}: {exc}); tell your instructor")
        _write_results(results, content)
        return content
    isolated, line = isolation.status()
    print(line if isolated else CONTAINER_LINE, flush=True)   # once, and never the not-isolated warning
    try:
        run = grade(root / "submission", results, workers=1, timeout=config["timeout"],
                    memory_mb=config["memory_mb"], exercises=config["exercises"], gradescope=True)
    except FileNotFoundError as exc:   # the grader's words are an instructor's ("one folder per student")
        content = failed_results("This submission could not be graded: no notebook was found in your upload; "
                                 "upload the course's .ipynb files themselves")
        print(exc, flush=True)   # the instructor's log keeps the grader's own words
    except Exception as exc:   # any refusal (a broken upload) is the student's to read
        content = failed_results(f"This submission could not be graded: {exc}")
    else:
        if len(run.submissions) == 1 and (results / "results.json").is_file():
            content = json.loads((results / "results.json").read_text(encoding="utf-8"))
            if not run.errors:
                return content
            # grading's own failure, not the student's: say so beside the scores
            content["output"] += " The grader hit an error of its own; ask your instructor: " + "; ".join(run.errors)
        else:
            names = ", ".join(s.student for s in run.submissions)
            content = failed_results(f"This submission could not be graded: expected the notebooks themselves (or "
                                     f"one folder holding them), found {len(run.submissions)} folders ({names}); "
                                     f"upload the .ipynb files")
    _write_results(results, content)
    return content


_positive_float = number(float, lambda value: 0 < value < float("inf"), "a number > 0")
_memory_mb = number(int, lambda value: value >= MEMORY_FLOOR_MB, f"megabytes ({MEMORY_FLOOR_MB} or more)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m course_lib autograder",
        description="Write Gradescope's autograder archive (setup.sh, run_autograder): upload it as a "
                    "programming assignment's autograder; each submission is graded by the course's checkers.")
    parser.add_argument("out", metavar="OUT.zip", help="the archive to write")
    parser.add_argument("--exercises", type=exercise_ids, default=None, metavar="IDS",
                        help="'2.1,2.2', notebook numbers '02,03', or 'all' (default: each submission on the "
                             "exercises of the notebooks it holds)")
    parser.add_argument("--timeout", type=_positive_float, default=TIMEOUT, metavar="SECONDS",
                        help="time limit per notebook; its exercises share it (default %(default)g, so that "
                             "twelve notebooks stay inside Gradescope's 10 minutes)")
    parser.add_argument("--memory-mb", type=_memory_mb, default=MEMORY_MB, metavar="MB",
                        help="memory per exercise beyond the course's own (default %(default)s, inside "
                             "Gradescope's 768 MB)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        names = write_autograder(args.out, args.exercises, timeout=args.timeout,
                                 memory_mb=args.memory_mb)
    except (ValueError, FileNotFoundError, RuntimeError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:   # the file system's answer (no permission, a full disk): one line, not a traceback
        print(f"error: out: could not write {args.out} ({exc.strerror or exc}); choose a folder you can write",
              file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {', '.join(names)}")
    print("Gradescope: a programming assignment, Configure Autograder, Zip file upload, base image Ubuntu 22.04; "
          "students upload their .ipynb files.")
    return 0


def _run_autograder_main(argv: list[str]) -> int:
    """``python -m course_lib.classroom.grading.autograder [ROOT]`` (run_autograder's command); a ROOT that is
    no folder is one line and exit status 2."""
    try:
        run_autograder(argv[0] if argv else os.environ.get("AUTOGRADER_ROOT", "/autograder"))
    except (ValueError, TypeError, NotADirectoryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":   # run_autograder: python -m course_lib.classroom.grading.autograder /autograder
    sys.exit(_run_autograder_main(sys.argv[1:]))

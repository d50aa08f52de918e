"""`python -m course_lib doctor`: is this machine ready for the workshop?"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
from importlib import metadata

import torch

from .._validate import describe
from ..course_files import KERNEL_NAME

PACKAGES = ("torch", "transformers", "tokenizers", "jupyterlab", "ipykernel", "ipywidgets",
            "matplotlib", "nbval", "tqdm", "pytest", "numpy")
NEEDED = set(PACKAGES) - {"nbval", "pytest"}   # those two only test the course


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _kernel_python() -> tuple[str | None, str]:
    """The Python that Jupyter here starts for the notebooks' kernel, and a note when there is none."""
    try:
        from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
    except ImportError:
        return None, "jupyter_client is not installed"
    try:
        argv = KernelSpecManager().get_kernel_spec(KERNEL_NAME).argv
    except NoSuchKernel:
        return None, f"Jupyter here has no '{KERNEL_NAME}' kernel"
    if not argv:
        return None, f"the '{KERNEL_NAME}' kernel has an empty command"
    # jupyter_client runs a kernel whose command is plain "python" with its own interpreter.
    plain = {"python", f"python{sys.version_info[0]}", f"python{sys.version_info[0]}.{sys.version_info[1]}"}
    return (sys.executable if argv[0] in plain else argv[0]), ""


def _imports_course_lib(python: str) -> bool:
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        return True   # this very interpreter is running course_lib
    try:
        # From a neutral folder: a course checkout in the current folder would be importable by accident.
        done = subprocess.run([python, "-c", "import course_lib"], capture_output=True, timeout=120,
                              cwd=tempfile.gettempdir())
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _check_kernel(say, problems: list[str]) -> None:
    python, why = _kernel_python()
    if python is None:
        say(f"  kernel        {KERNEL_NAME}: NOT FOUND ({why})")
        problems.append(f"Jupyter has no '{KERNEL_NAME}' kernel: run `make lab` from the course's checkout "
                        f"(or `{sys.executable} -m ipykernel install --user`)")
    elif _imports_course_lib(python):
        say(f"  kernel        {KERNEL_NAME}: {python} (imports course_lib)")
    else:
        say(f"  kernel        {KERNEL_NAME}: {python} CANNOT IMPORT course_lib")
        problems.append(f"the notebooks' kernel runs {python}, which cannot import course_lib: start Jupyter "
                        f"from the course's environment (`make lab`), or install the course into that Python "
                        f"(`{python} -m pip install <the course folder or wheel>`)")


def _check_corpora(say, problems: list[str]) -> None:
    from ..corpora import CORPORA, DATA_DIR_ENV, REPO_DATA_DIR, locate_corpus, search_dirs, user_data_dir
    say("  corpora are looked for in, in order:")
    env_set = bool(os.environ.get(DATA_DIR_ENV, "").strip())
    for number, folder in enumerate(search_dirs(), start=1):
        what = ", ".join(label for label, match in ((DATA_DIR_ENV, env_set and number == 1),
                                                    ("per-user folder", folder == user_data_dir()),
                                                    ("the checkout's data/", folder == REPO_DATA_DIR)) if match)
        say(f"    {number}. {folder}  ({what}{'' if folder.is_dir() else ', does not exist'})")
    for name in CORPORA:
        found = locate_corpus(name)
        if found.path is None:
            say(f"  corpus        {name}: NOT FOUND")
            problems.append(f"corpus {name} is missing: run `python -m course_lib data` to download it, or copy "
                            f"{CORPORA[name].filename} into {found.searched[0]}")
        else:
            verdict = "checksum OK" if found.checksum_ok else "CHECKSUM MISMATCH"
            say(f"  corpus        {name}: {found.path} ({verdict})")
            if not found.checksum_ok:
                problems.append(f"corpus {name} at {found.path} is corrupt: delete it and run "
                                f"`python -m course_lib data`")


def run_doctor(stream=None) -> int:
    """Print what a workshop needs and whether it is here; 0 when ready, 1 otherwise."""
    from ..runtime import course_threads, device

    problems: list[str] = []
    stream = stream or sys.stdout
    if not callable(getattr(stream, "write", None)):
        raise TypeError(f"stream: expected a text stream with .write (sys.stdout, a file, io.StringIO), got "
                        f"{describe(stream)}")
    say = lambda text="": print(text, file=stream)

    say("course_lib doctor")
    say(f"  python        {platform.python_version()} ({sys.executable})")
    say(f"  platform      {platform.platform()}")
    for package in PACKAGES:
        version = _version(package)
        say(f"  {package:<13} {version or 'MISSING'}")
        if version is None and package in NEEDED:
            problems.append(f"{package} is not installed: run `make lab` (or `pip install -c constraints.txt .` "
                            f"from the course's folder)")
    try:
        chosen = device()
        say(f"  device        {chosen} (cuda available: {torch.cuda.is_available()}, "
            f"mps available: {torch.backends.mps.is_available()})")
    except (RuntimeError, ValueError) as exc:
        say(f"  device        ERROR: {exc}")
        problems.append(str(exc))
    say(f"  threads       {torch.get_num_threads()} torch threads on {os.cpu_count()} CPUs")
    try:
        course_threads()
    except ValueError as exc:   # every notebook and `train` would stop on it
        problems.append(str(exc))
    _check_kernel(say, problems)
    _check_corpora(say, problems)
    say()
    if problems:
        say("NOT READY:")
        for problem in problems:
            say(f"  - {problem}")
        return 1
    say("READY: everything the workshop needs is here.")
    return 0

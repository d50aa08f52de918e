"""`python -m course_lib doctor`: is this machine ready for the workshop?"""
from __future__ import annotations

import platform
import sys
from importlib import metadata

import torch

KERNEL_NAME = "attention-course"
PACKAGES = ("torch", "transformers", "tokenizers", "jupyterlab", "ipykernel", "ipywidgets",
            "matplotlib", "nbval", "tqdm", "pytest", "numpy")
NEEDED = {"torch", "transformers", "tokenizers", "jupyterlab", "ipykernel", "ipywidgets",
          "matplotlib", "tqdm", "numpy"}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _kernel_registered() -> bool:
    try:
        from jupyter_client.kernelspec import KernelSpecManager
        return KERNEL_NAME in KernelSpecManager().find_kernel_specs()
    except Exception:   # noqa: BLE001 - no jupyter_client is itself the answer
        return False


def run_doctor(stream=None) -> int:
    """Print what a workshop needs and whether it is here; 0 when ready, 1 otherwise."""
    from .data import CORPORA, locate_corpus
    from .runtime import device

    problems: list[str] = []
    stream = stream or sys.stdout
    say = lambda text="": print(text, file=stream)   # noqa: E731

    say("course_lib doctor")
    say(f"  python        {platform.python_version()} ({sys.executable})")
    say(f"  platform      {platform.platform()}")
    if sys.version_info < (3, 10):
        problems.append("Python 3.10 or newer is needed: create the environment with a newer python3")
    for package in PACKAGES:
        version = _version(package)
        say(f"  {package:<13} {version or 'MISSING'}")
        if version is None and package in NEEDED:
            problems.append(f"{package} is not installed: run `make lab` (or `pip install -e . -c constraints.txt`)")
    try:
        chosen = device()
        say(f"  device        {chosen} (cuda available: {torch.cuda.is_available()}, "
            f"mps available: {torch.backends.mps.is_available()})")
    except (RuntimeError, ValueError) as exc:
        say(f"  device        ERROR: {exc}")
        problems.append(str(exc))
    say(f"  threads       {torch.get_num_threads()} torch threads on {__import__('os').cpu_count()} CPUs")
    kernel = _kernel_registered()
    say(f"  kernel        {KERNEL_NAME}: {'registered' if kernel else 'not registered'}")
    if not kernel:
        problems.append(f"the Jupyter kernel '{KERNEL_NAME}' is not registered: run `make lab` "
                        f"(or `python -m ipykernel install --sys-prefix --name {KERNEL_NAME}`)")
    for name in CORPORA:
        found = locate_corpus(name)
        if found.path is None:
            say(f"  corpus        {name}: NOT FOUND (searched {', '.join(str(p) for p in found.searched)})")
            problems.append(f"corpus {name} is missing: run `python -m course_lib data` to download it, "
                            f"or copy {CORPORA[name].filename} into one of the folders searched")
        else:
            verdict = "checksum OK" if found.checksum_ok else "CHECKSUM MISMATCH"
            say(f"  corpus        {name}: {found.path} ({verdict})")
            if not found.checksum_ok:
                problems.append(f"corpus {name} at {found.path} is corrupt: delete it and run "
                                f"`python -m course_lib data`")
    say()
    if problems:
        say("NOT READY:")
        for problem in problems:
            say(f"  - {problem}")
        return 1
    say("READY: everything the workshop needs is here.")
    return 0

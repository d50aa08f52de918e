"""Writing a learner copy without ever losing what a student wrote in it.

A learner copy is refreshed only when the student never changed it. A copy with the
student's edits is kept as it is, and the new version is written beside it as
``NAME.updated.ipynb``. "Changed" means the cells a student writes: their types and
sources. Running cells (outputs, execution counts) or metadata that Jupyter adds are
not edits, so a copy that was only run is refreshed like an untouched one.

Each folder of learner copies holds a small record, ``.course-copies.json``, of what
was last written to each copy; without it (deleted, or copies made by hand) every
copy that differs from the new version counts as edited, which errs on the safe side.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import nbformat

from .._atomic import atomic_file, remove_stale_staging

__all__ = ["MANIFEST_NAME", "CopyOutcome", "fingerprint", "place_learner_copy", "write_notebook_atomic"]

MANIFEST_NAME = ".course-copies.json"
ACTIONS = ("created", "up to date", "refreshed", "kept")


@dataclass(frozen=True)
class CopyOutcome:
    """What happened to one learner copy: ``action`` is one of ``ACTIONS``."""

    path: Path                       # the student's copy
    action: str
    new_version: Path | None = None  # where the new version is, when the student's copy was kept
    note: str = ""                   # e.g. "5 exercises"

    @property
    def written(self) -> Path:
        """The file that holds the course's current version of this notebook."""
        return self.new_version if self.action == "kept" and self.new_version else self.path

    def line(self) -> str:
        """One line for the terminal, saying what was done and why."""
        note = f" ({self.note})" if self.note else ""
        if self.action == "created":
            return f"created    {self.path}{note}"
        if self.action == "up to date":
            return f"up to date {self.path}"
        if self.action == "refreshed":
            return f"refreshed  {self.path}{note}: the course changed and you had not edited this copy"
        if self.new_version is None:
            return f"kept       {self.path}: it holds your work, and the course has not changed"
        return (f"kept       {self.path}: it holds your work, so it was not touched; "
                f"the course's new version is {self.new_version}")


def fingerprint(nb: nbformat.NotebookNode) -> str:
    """A hash of what a student writes in a notebook: each cell's type and source, in order."""
    cells = [[cell.get("cell_type", ""), cell.get("source", "")] for cell in nb.get("cells", [])]
    return hashlib.sha256(json.dumps(cells, ensure_ascii=False).encode("utf-8")).hexdigest()


def _file_fingerprint(path: Path) -> str | None:
    """The fingerprint of a notebook on disk; None when it cannot be read as one (treated as edited)."""
    try:
        return fingerprint(nbformat.read(path, as_version=4))
    except Exception:  # a file we cannot read is one we must not overwrite
        return None


def write_notebook_atomic(nb: nbformat.NotebookNode, out_path: Path) -> None:
    """Write a notebook so that a reader sees the old file or the new one, never half of one."""
    text = nbformat.writes(nb)
    with atomic_file(out_path) as handle:
        handle.write(text if text.endswith("\n") else text + "\n")


class _Manifest:
    """The folder's record of the fingerprint last written to each copy, by file name."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / MANIFEST_NAME
        try:
            loaded = json.loads(self.path.read_text(encoding="utf-8"))
            self.written = {k: v for k, v in loaded.get("written", {}).items()
                            if isinstance(k, str) and isinstance(v, str)}
        except (OSError, ValueError, AttributeError):
            self.written = {}   # no record: every differing copy counts as edited

    def save(self) -> None:
        text = json.dumps({"about": "what `python -m course_lib start` last wrote to each learner copy; "
                                    "safe to delete", "written": dict(sorted(self.written.items()))},
                          indent=1) + "\n"
        with atomic_file(self.path) as handle:
            handle.write(text)


def _updated_path(dst: Path, new: str, manifest: _Manifest) -> tuple[Path, bool]:
    """Where the new version goes beside an edited copy, and whether it must be written.

    ``NAME.updated.ipynb`` unless the student edited that file too; then ``NAME.updated-2.ipynb``, ...
    """
    for n in range(1, 1000):
        candidate = dst.with_name(f"{dst.stem}.updated{'' if n == 1 else f'-{n}'}{dst.suffix}")
        if not candidate.exists():
            return candidate, True
        current = _file_fingerprint(candidate)
        if current == new:
            return candidate, False
        if current is not None and current == manifest.written.get(candidate.name):
            return candidate, True   # an older version we wrote and nobody edited: refresh it
    raise FileExistsError(f"out_path: {dst.parent} already holds 999 '.updated' versions of {dst.name}; "
                          f"delete the ones you no longer need")


def place_learner_copy(nb: nbformat.NotebookNode, dst: Path, note: str = "") -> CopyOutcome:
    """Write the learner version ``nb`` to ``dst`` unless that would overwrite a student's edits."""
    # what an earlier run killed mid-write left beside this copy and the manifest (never a student's file)
    for name in (dst.name, MANIFEST_NAME):
        remove_stale_staging(dst.parent, name)
    manifest = _Manifest(dst.parent)
    new = fingerprint(nb)
    current = _file_fingerprint(dst) if dst.exists() else None
    if current is not None and current == new:
        outcome = CopyOutcome(dst, "up to date", note=note)
    elif not dst.exists() or (current is not None and current == manifest.written.get(dst.name)):
        outcome = CopyOutcome(dst, "refreshed" if dst.exists() else "created", note=note)
        write_notebook_atomic(nb, dst)
    elif manifest.written.get(dst.name) == new:
        # The student edited the copy and the course has not changed since it was written:
        # there is nothing new to put beside it.
        outcome = CopyOutcome(dst, "kept", note=note)
    else:
        beside, must_write = _updated_path(dst, new, manifest)
        if must_write:
            write_notebook_atomic(nb, beside)
        manifest.written[beside.name] = new
        outcome = CopyOutcome(dst, "kept", new_version=beside, note=note)
    if outcome.action != "kept":   # the copy now holds the new version
        manifest.written[dst.name] = new
    manifest.save()
    return outcome

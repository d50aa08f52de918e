"""The course's notebooks with their solutions taken out: what an isolated worker reads instead.

A worker needs the course's notebooks to know each exercise (its name, its cell, the check cell
after it), never the solutions: a submission could read them, or run them and pass. Each
``### BEGIN SOLUTION`` ... ``### END SOLUTION`` region keeps its two marker lines (they say which
cell is an exercise) and holds a ``raise NotImplementedError`` in between; outputs are dropped.
The course's own solutions are graded outside the sandbox (the self-check), never in it.
"""
from __future__ import annotations

import json
from pathlib import Path

from .. import notebook_reader as reader
from ..collect import WITHHELD

__all__ = ["write_stub_notebooks", "without_solutions"]


def without_solutions(source: str) -> str:
    """``source`` with each solution region's body replaced by ``raise NotImplementedError``."""
    kept: list[str] = []
    inside = False
    for line in source.splitlines(keepends=True):
        found = reader.marker(line)
        if found is not None and found.kind == "begin":
            inside = True
            kept += [line, f"{found.indent}raise NotImplementedError({WITHHELD!r})\n"]
        elif found is not None and found.kind == "end":
            inside = False
            kept.append(line)
        elif not inside:
            kept.append(line)
    return "".join(kept)


def write_stub_notebooks(notebooks: list[Path], folder: Path) -> Path:
    """Write each of ``notebooks`` without its solutions into ``folder`` (made); returns ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    for path in notebooks:
        notebook = json.loads(Path(path).read_text(encoding="utf-8"))
        for cell in notebook.get("cells", []):
            if cell.get("cell_type") != "code":
                continue
            source = cell.get("source", "")
            source = source if isinstance(source, str) else "".join(source)
            cell["source"] = without_solutions(source)
            cell["outputs"] = []
            cell["execution_count"] = None
        target = folder / Path(path).name
        target.write_text(json.dumps(notebook, indent=1, ensure_ascii=False), encoding="utf-8")
        target.chmod(0o644)
    return folder

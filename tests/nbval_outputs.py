"""Re-record notebooks' stored outputs exactly as strict nbval will compare them (`make outputs NB="05 08"`).

Run by the Makefile with NBVAL_ENV and the train record set, so the notebooks see the environment, the
threads and the recording of `make notebooks`. Each notebook runs in place, in its own folder, on a
kernel of this very Python (nbval's --nbval-current-env kernel); afterwards it says which cells'
outputs changed as nbval sees them: the same sanitizer (tests/nbval_sanitize.cfg), the same keys
skipped, the cells nbval ignores left out.

    python tests/nbval_outputs.py [05 08 ...]     # numbers or names; none: every notebook
"""
from __future__ import annotations

import copy
import difflib
import re
import sys
from collections import defaultdict
from pathlib import Path

import nbformat
from jupyter_client import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from nbval.kernel import CURRENT_ENV_KERNEL_NAME, NbvalKernelspecManager
from nbval.plugin import (
    coalesce_streams,
    find_comment_markers,
    find_metadata_tags,
    get_sanitize_patterns,
    transform_streams_for_comparison,
)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
SANITIZE = ROOT / "tests" / "nbval_sanitize.cfg"
CELL_TIMEOUT = 1200   # seconds, the Makefile's --nbval-cell-timeout
# What nbval leaves out of a comparison (nbval.plugin.IPyNbFile.skip_compare without --nbval-nbdime).
SKIP = {"metadata", "traceback", "prompt_number", "output_type", "name", "execution_count",
        "application/vnd.jupyter.widget-view+json", "image/png", "image/jpeg"}


def chosen(names: list[str]) -> list[Path]:
    """The notebooks named by number ("05") or name; every notebook when none is named."""
    every = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    if not names:
        return every
    picked = []
    for name in names:
        found = [p for p in every if p.name == name or p.stem == name or p.name.startswith(f"{name.zfill(2)}_")]
        if not found:
            sys.exit(f"NB: no notebook {name!r} in notebooks/ (expected a number like 05 or a name; "
                     f"there are {', '.join(p.name[:2] for p in every)})")
        picked += [p for p in found if p not in picked]
    return picked


def compared(cell, patterns: list[tuple[str, str]]) -> dict | None:
    """What strict nbval compares of a code cell's outputs (None: nbval does not compare this cell)."""
    options = dict(find_metadata_tags(cell.metadata))
    options.update(find_comment_markers(cell.source))
    if not options.get("check", True) or options.get("skip"):
        return None

    def clean(value):
        if isinstance(value, str):
            for regex, replace in patterns:
                value = re.sub(regex, replace, value)
        return value

    found = defaultdict(list)
    for output in transform_streams_for_comparison(coalesce_streams(copy.deepcopy(cell.outputs))):
        for key, value in output.items():
            if key in SKIP:
                continue
            if key == "data":
                for kind, shown in value.items():
                    if kind not in SKIP:
                        found[kind].append(clean(shown))
            else:
                found[key].append(clean(value))
    return dict(found)


def as_text(outputs: dict) -> list[str]:
    return [f"{key}: {line}" for key in sorted(outputs) for value in outputs[key]
            for line in (value if isinstance(value, str) else repr(value)).splitlines()]


def rerecord(path: Path, patterns: list[tuple[str, str]]) -> int:
    """Execute `path` in place; print the cells whose compared outputs changed; their number."""
    notebook = nbformat.read(path, as_version=4)
    before = [compared(c, patterns) for c in notebook.cells if c.cell_type == "code"]
    kernel = KernelManager(kernel_name=CURRENT_ENV_KERNEL_NAME, kernel_spec_manager=NbvalKernelspecManager())
    client = NotebookClient(notebook, km=kernel, timeout=CELL_TIMEOUT, resources={"metadata": {"path": str(path.parent)}})
    print(f"{path.name}: running ...", flush=True)
    try:
        client.execute()
    except CellExecutionError as err:   # nbval would fail on it too: the stored notebook is left as it was
        print(f"{path.name}: a cell raised, nothing written\n{err}", file=sys.stderr)
        return -1
    nbformat.write(notebook, path)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    changed = 0
    for number, (cell, old) in enumerate(zip(code, before)):
        new = compared(cell, patterns)
        if new is None or new == old:
            continue
        changed += 1
        first = cell.source.strip().splitlines()[0] if cell.source.strip() else ""
        print(f"  changed: Cell {number} (nbval's numbering)  {first[:70]}")
        for line in list(difflib.unified_diff(as_text(old or {}), as_text(new), lineterm="", n=0))[2:14]:
            print(f"    {line[:150]}")
    print(f"{path.name}: {changed} cell(s) changed" if changed else f"{path.name}: outputs unchanged", flush=True)
    return changed


def main(argv: list[str]) -> int:
    patterns = get_sanitize_patterns(SANITIZE.read_text(encoding="utf-8"))
    results = {path.name: rerecord(path, patterns) for path in chosen(argv)}
    failed = [name for name, changed in results.items() if changed < 0]
    print("summary: " + ", ".join(f"{name[:2]} {'FAILED' if n < 0 else f'{n} changed'}" for name, n in results.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

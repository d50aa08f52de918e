"""The package's two rules of layout, read from the source with ``ast`` (nothing is imported):

- the reference (every module of ``course_lib`` outside ``runs/`` and ``classroom/``) imports nothing
  from ``course_lib.runs`` or ``course_lib.classroom``: a student reads it without the machinery;
- the import graph of ``course_lib`` has no circle;
- no module uses another module's private name (``_name``): ``from .x import _name`` or ``x._name``.
  The package's private modules themselves (``_validate``, ``checks/engine/run``, ...) are shared
  inside the package and may be imported; what they define without an underscore is theirs to share.

Every import counts, at module level or inside a function; relative imports are resolved. The wings
are found from the folders, so moving a module between them needs no change here.
"""
from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "course_lib"
WINGS = ("course_lib.runs", "course_lib.classroom")   # the wings the reference may not import


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(root: Path) -> dict[str, Path]:
    return {_module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute name of ``from <dots><name> import ...`` written in ``module``."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if _is_package(path) else module.split(".")[:-1]
    base = package[:len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(name: str, known: dict[str, Path], top: str) -> str | None:
    """The module of ``known`` that importing ``name`` loads: itself, or the package that holds it."""
    if name in known:
        return name
    if not name.startswith(top + ".") and name != top:
        return None
    parent = name.rsplit(".", 1)[0]
    return _targets(parent, known, top) if parent != name else None


def imports(root: Path = PACKAGE) -> dict[str, set[str]]:
    """For each module of the package under ``root``, the modules of the package it imports."""
    known = _modules(root)
    top = root.name
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, path, node)
                names = []
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    names.append(full if full in known else base)   # from package import submodule
            else:
                continue
            found.update(t for t in (_targets(name, known, top) for name in names) if t and t != module)
        graph[module] = found
    return graph


def reference_wing_violations(root: Path = PACKAGE) -> list[str]:
    top = root.name
    wings = tuple(w.replace("course_lib", top, 1) for w in WINGS)
    broken = []
    for module, targets in imports(root).items():
        if module.startswith(wings) or module == f"{top}.__main__":
            continue   # the wings themselves, and the command line that starts them
        for target in sorted(targets):
            if target.startswith(wings):
                broken.append(f"{module} imports {target}")
    return broken


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_name_uses(root: Path = PACKAGE) -> list[str]:
    """Every use, in a module of the package, of a private name defined in another of its modules."""
    known = _modules(root)
    top = root.name
    found = []
    for module, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        bound: dict[str, str] = {}   # a local name -> the module or object of the package it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _resolve(module, path, node)
                if not (base == top or base.startswith(top + ".")):
                    continue
                for alias in node.names:
                    if _private(alias.name) and f"{base}.{alias.name}" not in known:
                        found.append(f"{module}: from {base} import {alias.name}")
                    bound[alias.asname or alias.name] = f"{base}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == top or alias.name.startswith(top + "."):
                        bound[alias.asname or alias.name.split(".")[0]] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in bound and f"{bound[node.value.id]}.{node.attr}" not in known):
                found.append(f"{module}: {node.value.id}.{node.attr}")
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a -> b -> ... -> a) for each strongly connected group of modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_circle(graph, set(group)) for group in groups]


def _circle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == start:
                    return paths[node] + [start]
                if nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no circle through {start} in {sorted(group)}")


def test_the_reference_imports_nothing_from_runs_or_the_classroom():
    broken = reference_wing_violations()
    assert not broken, ("the reference (course_lib outside runs/ and classroom/) must not import those wings:\n  "
                        + "\n  ".join(broken))


def test_the_package_has_no_import_circle():
    found = cycles(imports())
    assert not found, "import circles in course_lib:\n  " + "\n  ".join(" -> ".join(c) for c in found)


def test_no_module_uses_another_modules_private_name():
    found = private_name_uses()
    assert not found, "private names used outside their module:\n  " + "\n  ".join(found)


def test_the_private_name_rule_sees_imports_and_attributes(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "_shared.py").write_text("def helper():\n    pass\n")
    (package / "a.py").write_text("def _secret():\n    pass\n\nclass Model:\n    def _init(self):\n        pass\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text(
        "from .. import _shared\nfrom .. import a\nfrom ..a import _secret, Model\n\n"
        "def f():\n    _shared.helper()\n    a._secret()\n    Model._init(None)\n")
    assert sorted(private_name_uses(package)) == ["pkg.sub.b: Model._init", "pkg.sub.b: a._secret",
                                                  "pkg.sub.b: from pkg.a import _secret"]


def test_the_reading_sees_function_level_and_relative_imports(tmp_path):
    """The rules above can fail: a planted function-level import back up the tree is a circle, and a
    reference module's relative import of the classroom is a violation."""
    pkg = tmp_path / "course_lib"
    (pkg / "classroom" / "checks").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .attention import f\n")
    (pkg / "attention.py").write_text("def f():\n    from .classroom.checks import g\n    return g\n")
    (pkg / "classroom" / "__init__.py").write_text("")
    (pkg / "classroom" / "checks" / "__init__.py").write_text("from ... import attention\n\ndef g():\n    pass\n")
    assert reference_wing_violations(pkg) == ["course_lib.attention imports course_lib.classroom.checks"]
    assert cycles(imports(pkg)) == [["course_lib.attention", "course_lib.classroom.checks", "course_lib.attention"]]


def test_importing_the_reference_loads_no_classroom():
    """Only asking for the classroom, at its real path as every notebook does, loads it."""
    code = ("import sys\nimport course_lib, course_lib.train, course_lib.generate\n"
            "assert not [m for m in sys.modules if m.startswith('course_lib.classroom')], 'eager classroom'\n"
            "from course_lib.classroom import checks\n"
            "assert checks.__name__ == 'course_lib.classroom.checks' and callable(checks.check_causal_mask)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


# --- the shim for old import paths (course_lib/_moved.py): the one exception, for old copies only -------------

SHIM = "course_lib._moved"


def _parseable(source: str) -> str:
    """A notebook cell with IPython's magics and shell lines blanked (same line numbers), for ``ast``."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.split("\n"))


def hooked_imports(source: str, module: str = "__main__", is_package: bool = False) -> list[str]:
    """The import statements of ``source`` that work only through the shim: an old module path
    (``course_lib.checks``, ``course_lib.collect``) or a name that left a module (``course_lib.train.PRESETS``).
    ``module`` resolves relative imports when ``source`` is a module of the package."""
    from course_lib import _moved as shim
    found = []
    for node in sorted((n for n in ast.walk(ast.parse(_parseable(source))) if hasattr(n, "lineno")),
                       key=lambda n: n.lineno):
        if isinstance(node, ast.Import):
            old = [alias.name for alias in node.names if shim.new_path(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            package = module.split(".") if is_package else module.split(".")[:-1]
            base = (".".join(package[:len(package) - node.level + 1] + [node.module or ""]).rstrip(".")
                    if node.level else node.module or "")
            old = [base] if shim.new_path(base) else [
                f"{base}.{alias.name}" for alias in node.names
                if shim.new_path(f"{base}.{alias.name}") or alias.name in shim.MOVED_NAMES.get(base, {})]
        else:
            continue
        found += [f"line {node.lineno}: {ast.unparse(node)}" for _ in old[:1]]
    return found


def _code_cells(notebook) -> list[tuple[int, str]]:
    return [(index, cell.source) for index, cell in enumerate(notebook.cells) if cell.cell_type == "code"]


@functools.cache
def _notebooks_and_learner_copies() -> list[tuple[str, list[tuple[int, str]]]]:
    """Every solution notebook and the learner copy `course_lib student` / `start` makes of it."""
    import nbformat

    from course_lib.classroom.assignments import learner_notebook
    found = []
    for path in sorted((PACKAGE.parent / "notebooks").glob("*.ipynb")):
        found.append((path.name, _code_cells(nbformat.read(path, as_version=4))))
        found.append((f"learner copy of {path.name}", _code_cells(learner_notebook(path)[0])))
    return found


def test_the_hook_rule_sees_every_kind_of_old_import():
    """The rule below can fail: each way of importing through the shim is caught, the real paths are not."""
    old = ("from course_lib import checks, viz\n"
           "from course_lib import capstone as cap\n"
           "%matplotlib inline\n"
           "import course_lib.grading.cli\n"
           "def f():\n    from course_lib.collect import collect_student_parts\n"
           "from course_lib.train import PRESETS, lm_loss\n"
           "from course_lib.model import check_vocabulary\n"
           "from course_lib.hf.export import export\n")
    assert [line.split(":")[0] for line in hooked_imports(old)] == [f"line {n}" for n in (1, 2, 4, 6, 7, 8, 9)]
    real = ("from course_lib import GPT, viz, setup_notebook\nfrom course_lib.classroom import capstone, checks\n"
            "from course_lib.runs import PRESETS\nfrom course_lib.train import lm_loss, batches\n"
            "import course_lib.classroom.grading.cli\nfrom course_lib.hf import export_run\n")
    assert hooked_imports(real) == []
    assert hooked_imports("from . import checks\n", "course_lib", is_package=True) == ["line 1: from . import checks"]
    assert hooked_imports("from ..bench import x\n", "course_lib.classroom.y") == ["line 1: from ..bench import x"]
    assert hooked_imports("from .bench import x\n", "course_lib.runs.y") == []


def test_no_notebook_learner_copy_or_module_imports_through_the_shim():
    """Notebooks import `checks` from its real path (`from course_lib.classroom import checks`), so "go to
    definition" finds it; the shim is for copies students edited before the move, and nothing else."""
    found = []
    for name, cells in _notebooks_and_learner_copies():
        found += [f"{name}, cell {index}, {line}" for index, source in cells for line in hooked_imports(source)]
    for module, path in _modules(PACKAGE).items():
        if module != SHIM:
            found += [f"{module}, {line}" for line in
                      hooked_imports(path.read_text(encoding="utf-8"), module, _is_package(path))]
    assert not found, "imports through the old-path shim (course_lib/_moved.py):\n  " + "\n  ".join(found)


@pytest.mark.slow
def test_the_notebooks_imports_run_with_the_shim_switched_off():
    """Every course_lib import line of every notebook and learner copy, run with the shim's finder and the
    old names of model/train gone: none needs them."""
    lines = sorted({ast.unparse(node) for _, cells in _notebooks_and_learner_copies() for _, source in cells
                    for node in ast.walk(ast.parse(_parseable(source)))
                    if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "course_lib"
                    or isinstance(node, ast.Import) and any(a.name.split(".")[0] == "course_lib" for a in node.names)})
    assert any("checks" in line for line in lines), lines
    code = ("import sys\nimport course_lib, course_lib._moved as shim\n"
            "sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, shim.MovedModules)]\n"
            "for module in [m for name, m in sys.modules.items() if name.startswith('course_lib')]:\n"
            "    vars(module).pop('__getattr__', None)\n"
            "try:\n    from course_lib import checks\nexcept ImportError:\n    pass\n"
            "else:\n    raise AssertionError('the shim is still on')\n"
            + "".join(f"{line}\n" for line in lines))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr[-3000:]


def test_only_the_shim_hooks_imports_or_answers_missing_module_names():
    """The shim is the one module that touches the import system or gives a module a ``__getattr__``; the
    files students read (model.py, train.py, ...) hold only the lesson."""
    found = []
    for module, path in _modules(PACKAGE).items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if module == SHIM:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("meta_path", "path_hooks"):
                found.append(f"{module}: sys.{node.attr}")
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            if (isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
                    or any(isinstance(t, ast.Name) and t.id == "__getattr__" for t in targets)):
                found.append(f"{module}: a module-level __getattr__ (line {node.lineno})")
            if isinstance(node, ast.ImportFrom) and any(a.name == "_moved" for a in node.names) \
                    and module != "course_lib":
                found.append(f"{module}: imports the shim")
    assert not found, "only course_lib/_moved.py may hook imports:\n  " + "\n  ".join(found)


def test_old_import_paths_of_moved_modules_still_work_and_give_the_same_module():
    """A student's edited copy written before the move (`from course_lib import checks`,
    `from course_lib.collect import ...`) is never rewritten, so until the shim's end date the old paths keep
    working, lazily, handing back the very module; old names of model/train come from the shim too."""
    code = ("import sys\n"
            "import course_lib\n"
            "import course_lib.train, course_lib.model\n"
            "assert not any(m.startswith(('course_lib.classroom', 'course_lib.runs')) for m in sys.modules), 'eager'\n"
            "from course_lib.collect import collect_student_parts\n"
            "from course_lib.grading.cli import build_parser\n"
            "import course_lib.classroom.collect as new, course_lib.classroom.grading.cli as cli\n"
            "assert collect_student_parts is new.collect_student_parts and build_parser is cli.build_parser\n"
            "import course_lib.checks\n"
            "from course_lib import checks\n"
            "assert checks is sys.modules['course_lib.classroom.checks']\n"
            "assert new.__spec__.name == 'course_lib.classroom.collect'\n"
            "from course_lib.bench import time_call\n"
            "from course_lib.runs.bench import time_call as moved_time_call\n"
            "assert time_call is moved_time_call\n"
            "from course_lib.train import PRESETS, prepare_preset, Examples, TokenStream, _batches, lm_loss\n"
            "import course_lib.runs.presets as presets, course_lib.data as data, course_lib.train as train\n"
            "assert PRESETS is presets.PRESETS and Examples is data.Examples and _batches is train.batches\n"
            "from course_lib.model import ModernGPT\n"
            "try:\n"
            "    from course_lib.train import no_such_name\n"
            "except ImportError:\n"
            "    pass\n"
            "else:\n"
            "    raise AssertionError('an unknown name imported')\n"
            "try:\n"
            "    import course_lib.no_such_module\n"
            "except ModuleNotFoundError:\n"
            "    pass\n"
            "else:\n"
            "    raise AssertionError('an unknown module imported')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr

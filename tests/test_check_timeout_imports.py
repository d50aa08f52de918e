"""A check cut short while a module is being imported for the first time leaves no module half-imported behind.

Where checks run in the kernel's own process (macOS, Windows, ``COURSE_CHECK_IN_PROCESS=1``), the time limit (or
Ctrl-C) may land while the student's code, or torch lazily (sympy, torch._dynamo), imports a module for the first
time. Python takes the failed module out of sys.modules, but not the submodules it had finished (``pkg.sub`` with
``pkg`` gone): the next import of the package runs its code again, finds ``pkg.sub`` done and never sets it on the
new package, so every later check that reaches ``pkg.sub`` failed until the kernel restarted. And an interruption
landing in importlib's own bookkeeping left the module itself half-initialised in sys.modules. Each test makes the
interruption certain on an idle machine: a throwaway module whose top-level code sleeps past the limit, then the
same code (the sleep switched off) checked again in the same process must get its real verdict.
"""
from __future__ import annotations

import importlib
import signal
import sys
import textwrap

import pytest
import torch

from course_lib.classroom import checks
from course_lib.classroom.checks.engine import run

pytestmark = pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="the in-process time limit needs SIGALRM")

LIMIT_S = 0.5
SLEEP = """
import os, time
if os.path.exists(os.path.join(os.path.dirname(__file__), "SLOW")):
    time.sleep(30)   # past the check's limit: the alarm lands here, in the middle of the import
"""
TRIL = "import torch\n\ndef tril(n):\n    return torch.ones(n, n).tril().bool()\n"


@pytest.fixture
def in_process(monkeypatch, tmp_path):
    monkeypatch.setenv("COURSE_CHECK_IN_PROCESS", "1")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield monkeypatch
    for name in [n for n in sys.modules if n.split(".")[0] in ("slowpkg", "lazypkg", "kipkg", "halfmod")]:
        del sys.modules[name]


def _write(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    importlib.invalidate_caches()


def _timed_out_then_passes(monkeypatch, student, slow_flag) -> None:
    monkeypatch.setattr(run, "TIME_LIMIT_S", LIMIT_S)
    first = checks.check_causal_mask(student, graded=False)
    assert first.diagnosis == "timeout", first
    slow_flag.unlink()
    monkeypatch.setattr(run, "TIME_LIMIT_S", 60.0)   # the second check is judged, not raced
    second = checks.check_causal_mask(student, graded=False)
    assert second.passed, second


def test_a_package_cut_short_leaves_no_finished_submodule_behind(in_process, tmp_path):
    _write(tmp_path, {"slowpkg/__init__.py": "from .sub import tril\n" + SLEEP, "slowpkg/sub.py": TRIL,
                      "slowpkg/SLOW": ""})

    def student(n):
        import slowpkg.sub
        return slowpkg.sub.tril(n)
    _timed_out_then_passes(in_process, student, tmp_path / "slowpkg" / "SLOW")
    assert getattr(sys.modules["slowpkg"], "sub", None) is sys.modules["slowpkg.sub"]


def test_a_lazy_submodule_of_an_imported_package_cut_short(in_process, tmp_path):
    # as torch imports torch._dynamo on first use: the package is imported before the check, the submodule (a
    # package of its own) during it, from the package's module __getattr__
    _write(tmp_path, {
        "lazypkg/__init__.py": """
            import importlib
            def __getattr__(name):
                if name == "heavy":
                    return importlib.import_module(".heavy", __name__)
                raise AttributeError(name)
        """,
        "lazypkg/heavy/__init__.py": "from .part import tril\n" + SLEEP,
        "lazypkg/heavy/part.py": TRIL, "lazypkg/heavy/SLOW": ""})
    import lazypkg

    def student(n):
        return lazypkg.heavy.part.tril(n)
    _timed_out_then_passes(in_process, student, tmp_path / "lazypkg" / "heavy" / "SLOW")
    assert "heavy" in vars(lazypkg)


def test_ctrl_c_during_an_import_leaves_no_finished_submodule_behind(in_process, tmp_path):
    _write(tmp_path, {"kipkg/__init__.py": """
                          import os
                          from .sub import tril
                          if os.path.exists(os.path.join(os.path.dirname(__file__), "SLOW")):
                              raise KeyboardInterrupt   # the stop button, pressed while the package imports
                      """, "kipkg/sub.py": TRIL, "kipkg/SLOW": ""})

    def student(n):
        import kipkg.sub
        return kipkg.sub.tril(n)
    with pytest.raises(KeyboardInterrupt):
        checks.check_causal_mask(student, graded=False)
    assert not [name for name in sys.modules if name.startswith("kipkg")]
    (tmp_path / "kipkg" / "SLOW").unlink()
    assert checks.check_causal_mask(student, graded=False).passed


def test_a_module_left_half_initialised_in_sys_modules_is_taken_out(in_process, tmp_path):
    # What importlib leaves when the interruption lands in its own bookkeeping, after it put the module in
    # sys.modules (marked initialising) and before it took the failed one out: done here by hand, as
    # importlib._bootstrap._load_unlocked does, so that the alarm lands in the module's code every time.
    _write(tmp_path, {"halfmod.py": SLEEP + TRIL, "SLOW": ""})

    def student(n):
        if "halfmod" not in sys.modules and (tmp_path / "SLOW").exists():
            spec = importlib.util.find_spec("halfmod")
            module = importlib.util.module_from_spec(spec)
            spec._initializing = True
            sys.modules["halfmod"] = module
            spec.loader.exec_module(module)
        import halfmod
        return halfmod.tril(n)
    (tmp_path / "SLOW").write_text("")
    in_process.setattr(run, "TIME_LIMIT_S", LIMIT_S)
    assert checks.check_causal_mask(student, graded=False).diagnosis == "timeout"
    assert "halfmod" not in sys.modules
    (tmp_path / "SLOW").unlink()
    in_process.setattr(run, "TIME_LIMIT_S", 60.0)
    assert checks.check_causal_mask(student, graded=False).passed


def test_the_alarm_never_rings_inside_importlib_bookkeeping():
    # the frame of importlib's bootstrap that asks a finder for a module's spec
    frames = []

    class Finder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "no_such_module_for_the_alarm":
                frames.append(sys._getframe(1))
            return None
    sys.meta_path.insert(0, Finder)
    try:
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("no_such_module_for_the_alarm")
    finally:
        sys.meta_path.remove(Finder)
    assert frames and frames[0].f_code.co_filename == importlib._bootstrap._find_and_load.__code__.co_filename
    assert run._ring(signal.SIGALRM, frames[0]) is None   # deferred: the timer rings again 0.1 s later
    with pytest.raises(run.CheckTimeout):
        run._ring(signal.SIGALRM, sys._getframe())   # anywhere else, as always


def test_a_loop_of_imports_still_times_out_in_process(in_process):
    in_process.setattr(run, "TIME_LIMIT_S", LIMIT_S)

    def student(n):
        while True:
            importlib.import_module("os")
            importlib.import_module("torch.nn")
    assert checks.check_causal_mask(student, graded=False).diagnosis == "timeout"


def test_a_failed_import_of_modules_imported_before_the_check_is_left_alone(in_process, tmp_path):
    # what was imported before the check (torch's own submodules) is never taken out, whatever the student's
    # code imports
    before = {name: module for name, module in sys.modules.items() if name.startswith("torch")}
    _write(tmp_path, {"slowpkg/__init__.py": "import torch.nn.functional\nfrom .sub import tril\n" + SLEEP,
                      "slowpkg/sub.py": TRIL, "slowpkg/SLOW": ""})

    def student(n):
        import slowpkg
        return slowpkg.tril(n)
    _timed_out_then_passes(in_process, student, tmp_path / "slowpkg" / "SLOW")
    assert all(sys.modules.get(name) is module for name, module in before.items())
    assert torch.nn.functional is sys.modules["torch.nn.functional"]


def test_a_library_package_cut_short_is_imported_again_in_full(in_process, tmp_path):
    # torch._dynamo cut short (R29): its finished submodules registered their work with torch (taken out, they
    # would register it twice: "already registered"), and torch._inductor, which it imports, reads
    # torch._dynamo.utils off the package while it imports. The package is imported again after the check, its
    # finished submodules set on it first.
    library = tmp_path / "site"
    library.mkdir()
    in_process.syspath_prepend(str(library))
    in_process.setattr(run, "is_student_file",   # site/ as an installed library's folder
                      lambda name, own=run.is_student_file: own(name) and not name.startswith(str(library)))
    _write(library, {
        "slowpkg/__init__.py": """
            import os, time
            from . import registered
            from .reader import tril
            flag = os.path.join(os.path.dirname(__file__), "SLOW")
            if os.path.exists(flag):
                os.remove(flag)
                time.sleep(30)   # the first import only: the alarm lands here
        """,
        "slowpkg/registered.py": """
            import builtins
            if getattr(builtins, "_slowpkg_registered", False):
                raise RuntimeError("registered twice")
            builtins._slowpkg_registered = True
        """,
        "slowpkg/reader.py": "import slowpkg\nassert slowpkg.registered\n" + TRIL,
        "slowpkg/SLOW": ""})
    import builtins

    def student(n):
        import slowpkg
        return slowpkg.tril(n)
    in_process.setattr(builtins, "_slowpkg_registered", False, raising=False)
    in_process.setattr(run, "TIME_LIMIT_S", LIMIT_S)
    assert checks.check_causal_mask(student, graded=False).diagnosis == "timeout"
    package = sys.modules["slowpkg"]
    assert package.registered is sys.modules["slowpkg.registered"] and package.reader is sys.modules["slowpkg.reader"]
    in_process.setattr(run, "TIME_LIMIT_S", 60.0)
    assert checks.check_causal_mask(student, graded=False).passed

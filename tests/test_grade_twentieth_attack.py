"""A twentieth and a twenty-first attack on the grader (2026-11-30): eleven classes past the sandbox, and honest code
it refused.

- The guards' originals were reachable: ``_signal.signal.__kwdefaults__`` and ``gc.set_debug.__closure__`` held the
  functions they stand for (a signal handler is handed a frame; DEBUG_SAVEALL keeps dead frames). The guards keep
  them in defaults only, which the policy refuses to read near the student's code; gc.garbage is a stand-in.
- A frame helper called through another library's call (``weakref.finalize``'s ``__call__``, a singledispatch
  wrapper) passed for one the library asked itself.
- ``dir_fd=``: the open event shows a path relative to a descriptor without the descriptor; a descriptor of a folder
  outside the working folder is refused.
- The grader's own state was the student's to rewrite: the checks' rule of whose file is whose (the policy has its
  own now, on its own copies of the builtins and ``os.path``, and its guards' globals are not its tables), the
  judge's functions and the pinned table they were put back from, the pin table through ``accept``, and
  ``sys.modules`` read by a late import of the checks. The judge takes the checkers and the course's state before
  any student code and says ``patched`` when the course is not as it was once put back; ``accept`` is not the
  student's.
- torch's dispatcher: a kernel registered for ``aten::equal`` from Python made every comparison True.

The twenty-first went past those fixes: a frame helper through another standard-library module (reprlib: any module
of the standard library between the student and a frame helper now counts as passing the call on), torch's Python
dispatcher (``py_impl`` kernels; switching it on is refused to the student), a symbolic link flipped by a thread
between the check of a path and its open (no links at all now), another torch function in ``torch.equal``'s place
(torch's own rebinding must wrap the pinned function), and the course's objects changed in place (a frozen
declaration's field, the pin tables, a checker's closure cell: the judge compares those too).

Honest code refused: a pydantic model (pydantic reads the defining frame's locals), ``traceback.format_exc(limit=2)``
(traceback slices its walker) and a singledispatch registration that notebook_reader sometimes left behind.
"""
from __future__ import annotations

import platform
import sys

import pytest
from sandboxed_judge import judged_in_sandbox

LINUX = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")
_WRONG = "    return torch.zeros(n, n, dtype=torch.bool)   # wrong: everything hidden\n"
_RIGHT = "torch.tril(torch.ones(n, n, dtype=torch.bool, device=device))"
_MODULES = "import sys\n_M = sys.modules\n"

REFUSED = {
    "a guard's original in its defaults": "import _signal\ndef causal_mask(n, _o=_signal.signal.__kwdefaults__):\n"
                                          + _WRONG,
    "gc's guard's original": "import gc\ndef causal_mask(n, _o=gc.set_debug.__kwdefaults__):\n" + _WRONG,
    "a frame helper through weakref.finalize": (
        "import weakref\nfrom pydantic import TypeAdapter\nclass _K:\n    pass\n_k = _K()\n"
        "def causal_mask(n, _f=weakref.finalize(_k, TypeAdapter(int)._fetch_parent_frame)()):\n" + _WRONG),
    "a frame helper through a singledispatch wrapper": (
        "import functools\nfrom pydantic import TypeAdapter\n"
        "def causal_mask(n, _f=functools.singledispatch(TypeAdapter._fetch_parent_frame)(TypeAdapter(int))):\n"
        + _WRONG),
    "a descriptor of a folder outside": "import os\ndef causal_mask(n, _d=os.open('/', os.O_RDONLY)):\n" + _WRONG,
    "os.path.realpath rebound, then a write outside": (
        "import os, posixpath\ndef _write():\n    home, real = os.getcwd(), posixpath.realpath\n"
        "    posixpath.realpath = lambda path, *a, **k: home + '/inside'\n"
        "    try:\n        open(os.path.join(os.path.dirname(home), 'outside.txt'), 'w').write('x')\n"
        "    finally:\n        posixpath.realpath = real   # (the next source judged in this process)\n"
        "def causal_mask(n, _w=_write()):\n" + _WRONG),
    "the checks' rule of whose file is whose rebound": (
        _MODULES + "def _frame():\n    _M['course_lib.classroom.checks._student_files']._outside_student = "
        "lambda name: True\n    return sys._getframe(1)\ndef causal_mask(n, _f=_frame()):\n" + _WRONG),
    "a course function's code replaced": (
        _MODULES + "def _swap():\n    _M['course_lib.classroom.grading.judge']._verdict.__code__ = "
        "(lambda *a: None).__code__\ndef causal_mask(n, _s=_swap()):\n" + _WRONG),
    "the policy's tables through a guard's globals": (
        "import _signal, sys\ndef _frame():\n    tables = _signal.signal.__globals__\n"
        "    tables['_GETFRAME_READERS'] = tables.get('_GETFRAME_READERS', ()) + (('.py', frozenset({'_frame'})),)\n"
        "    tables['_FRAME_HANDERS'] = ()\n    return sys._getframe(1)\ndef causal_mask(n, _f=_frame()):\n" + _WRONG),
    # the twenty-first: a standard library's module between (reprlib), the Python dispatcher, a link flipped by a thread
    "a frame helper through reprlib": (
        "import reprlib\nfrom pydantic import TypeAdapter\n"
        "def causal_mask(n, _f=reprlib.recursive_repr()(TypeAdapter._fetch_parent_frame)(TypeAdapter(int))):\n"
        + _WRONG),
    "torch's Python dispatcher": ("def _on():\n    torch.ops.aten.equal.default.py_impl(torch._C.DispatchKey.CPU)"
                                  "(lambda a, b: True)\n    return [torch._C._EnablePythonDispatcher()]\n"
                                  "def causal_mask(n, _k=_on()):\n" + _WRONG),
    "a symbolic link": "import os\ndef causal_mask(n, _l=os.symlink('.', 'here')):\n" + _WRONG,
    "a kernel for aten::equal": ("def _register():\n    lib = torch._C._dispatch_library('IMPL', 'aten', '', 'x.py', 1)\n"
                                 "    lib.impl('equal', 'CPU', lambda a, b: True, False)\n    return lib\n"
                                 "def causal_mask(n, _l=_register()):\n" + _WRONG),
}
# each changes what the judge computes with, with no frame: the verdict is ``patched``
PATCHED = {
    "the judge's verdict function and the table it is put back from": (
        _MODULES + "def _rebind():\n    J = _M['course_lib.classroom.grading.judge']\n"
        "    R = _M['course_lib.classroom.checks._references']\n"
        "    mine = lambda plan, record, error: {'exercise': plan.id, 'passed': True, 'diagnosis': None, 'message': 'ok'}\n"
        "    J._from_checks = mine\n    R._PRISTINE[J]['_from_checks'] = mine\n"
        "def causal_mask(n, _r=_rebind()):\n" + _WRONG),
    "the checks' package in sys.modules": (
        _MODULES + "import types\ndef _swap():\n    from course_lib.classroom.verdict import CheckResult\n"
        "    real = _M['course_lib.classroom']\n    fake = types.ModuleType('course_lib.classroom')\n"
        "    fake.__dict__.update({k: v for k, v in vars(real).items() if k != 'checks'})\n"
        "    fake.checks = types.SimpleNamespace(check_causal_mask=lambda *a, **k: CheckResult('2.1', True, None, 'ok'))\n"
        "    _M['course_lib.classroom'] = fake\ndef causal_mask(n, _s=_swap()):\n" + _WRONG),
    # the twenty-first: torch's own code in torch.equal's place, the course's objects changed in place
    "torch.equal bound to another of torch's functions": (
        "def _go():\n    import torch.testing._comparison as c\n    torch.equal = c.default_tolerances\n"
        "def causal_mask(n, _g=_go()):\n" + _WRONG),
    "a frozen declaration's field": (
        _MODULES + "def _go():\n    declared = _M['course_lib.classroom.checks.notebook02'].CAUSAL_MASK\n"
        "    object.__setattr__(declared, 'reference', lambda n: torch.zeros(n, n, dtype=torch.bool))\n"
        "def causal_mask(n, _g=_go()):\n" + _WRONG),
    "the pin tables emptied": (
        _MODULES + "def _go():\n    p = _M['course_lib.classroom.checks._pinned']\n"
        "    p._BY_SPACE.clear(); p._CLASS_NAMES.clear(); p.PINNED.clear()\n    torch.equal = lambda a, b: True\n"
        "def causal_mask(n, _g=_go()):\n" + _WRONG),
    "a checker's closure cell": (
        _MODULES + "def _go():\n    check = _M['course_lib.classroom.checks.notebook02'].check_causal_mask\n"
        "    dict(zip(check.__code__.co_freevars, check.__closure__))['body'].cell_contents = lambda fn: 'ok'\n"
        "def causal_mask(n, _g=_go()):\n" + _WRONG),
    "a replacement pinned through accept": (
        _MODULES + "import operator\ndef _accept():\n    torch.equal = operator.is_not\n"
        "    _M['course_lib.classroom.checks._pinned'].accept(torch, 'equal')\n"
        "def causal_mask(n, _a=_accept()):\n" + _WRONG),
}
HONEST = {
    "a pydantic model": ("from pydantic import BaseModel\nclass Spec(BaseModel):\n    n: int\n"
                         f"def causal_mask(n, device=None):\n    n = Spec(n=n).n\n    return {_RIGHT}\n"),
    "traceback.format_exc(limit=2)": ("import traceback\ndef causal_mask(n, device=None):\n    try:\n        int('x')\n"
                                      "    except ValueError:\n        traceback.format_exc(limit=2)\n"
                                      f"    return {_RIGHT}\n"),
    "rich's progress bar": ("import io\nfrom rich.console import Console\nfrom rich.progress import track\n"
                            "def causal_mask(n, device=None):\n    for _ in track(range(2), console=Console(file=io.StringIO())):\n"
                            f"        pass\n    return {_RIGHT}\n"),
    "a finalizer and a reduce": ("import functools, operator, weakref\nclass _Holder:\n    pass\n"
                                 "def causal_mask(n, device=None):\n    h = _Holder()\n    weakref.finalize(h, print, 'bye')\n"
                                 f"    n = functools.reduce(operator.add, [0, n])\n    return {_RIGHT}\n"),
}


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="the sandbox as a forked exercise's process enters it")
def test_the_twentieth_attacks_are_refused_or_patched_and_honest_code_passes(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    verdicts = iter(judged_in_sandbox(home, "2.1", [*REFUSED.values(), *HONEST.values()]))
    for name, verdict in zip(REFUSED, verdicts):
        assert (verdict["passed"], verdict["diagnosis"]) == (False, "exception"), (name, verdict)
        assert "sandbox does not allow" in verdict["message"], (name, verdict)
    for name, verdict in zip(HONEST, verdicts):
        assert verdict["passed"] is True, (name, verdict)
    assert not (tmp_path / "outside.txt").exists()
    for index, (name, source) in enumerate(PATCHED.items()):   # each in a process of its own, as in the grader:
        (tmp_path / str(index)).mkdir()                        # what they change outlives the judge's call
        verdict, = judged_in_sandbox(tmp_path / str(index), "2.1", [source])
        assert (verdict["passed"], verdict["diagnosis"]) == (False, "patched"), (name, verdict)

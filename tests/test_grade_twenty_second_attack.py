"""A twenty-second attack on the grader (2026-11-30): ten ways past the fixes of the twentieth and twenty-first, none
of them through a frame.

- torch's dispatcher guarded by one name and by its caller: torch keeps the Python dispatcher's switch under other
  names too (``torch._dispatch.python.enable_python_dispatcher``), and ``torch.library.impl`` reaches the library
  call through torch's own functions. Every name torch bound them to is guarded now, the switch is refused while the
  student's code runs at any depth, and so is a kernel for torch's own operators (but for the keys torch registers
  lazily, vmap's batching rules); the judge compares the switch and the kernels registered too.
- The course's state compared once, at the end: a change undone before then (by a finalizer, by the student's own
  last call) went unseen. The judge compares it before and after each checker call as well.
- State behind a function's own globals: ``CheckResult.__new__`` (a NamedTuple's) looks ``_tuple_new`` up in a dict
  of its own. Such dicts of the course's classes are compared too.
- torch's global module hooks (a forward hook rewrote the reference's output): compared and put back like the other
  hooks that run unasked.
- The judge looked functions up after the student's code ran: ``builtins.__import__`` (its lazy import of the
  reference guard answered by a fake) and ``ast.parse`` (the check cell rewritten to check the course's function).
  Both are taken before; ``__import__`` is pinned; a checker handed the course's own function is ``calls_reference``.
- Without isolation: a folder renamed back and forth by a thread while a path through it is opened (refused: no
  folder is renamed), and ``torch.from_file`` opening files where no open event is raised (it raises one now).

The twenty-third went past those fixes: a name added to the course (a field of a frozen declaration shadowing its
class's method, a module object bound as a module's ``bool``), compared now by the names each namespace holds (a
submodule Python imports from the package's own folder aside); and the Python dispatcher switched on from a finalizer
with no frame of the student's (refused at any time in an exercise's process now).
"""
from __future__ import annotations

import platform
import sys

import pytest
from sandboxed_judge import judged_in_sandbox

LINUX = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")
_WRONG = "    return torch.zeros(n, n, dtype=torch.bool)   # wrong: everything hidden\n"
_MODULES = "import sys\n_M = sys.modules\n"

REFUSED = {
    "torch's other name for the Python dispatcher's switch": (
        _MODULES + "def _on():\n    torch.ops.aten.equal.default.py_impl(torch._C.DispatchKey.CPU)(lambda a, b: True)\n"
        "    return [_M['torch._dispatch.python'].enable_python_dispatcher()]\ndef causal_mask(n, _k=_on()):\n"
        + _WRONG),
    "torch.library.impl for aten::equal": (
        "def causal_mask(n, _k=torch.library.impl('aten::equal', 'CPU', lambda a, b: True)):\n" + _WRONG),
    "a folder renamed": "import os\ndef causal_mask(n, _m=os.makedirs('d/e'), _r=os.rename('d/e', 'd/f')):\n" + _WRONG,
    "torch.from_file writing outside": (
        "import os\ndef causal_mask(n, _f=torch.from_file(os.path.join(os.path.dirname(os.getcwd()), 'outside.bin'), "
        "shared=True, size=4)):\n" + _WRONG),
}
# each changes what the judge computes with: ``patched``, in a process of its own as in the grader
PATCHED = {
    "a frozen field changed, undone by the student's first call": (
        _MODULES + "_E = _M['course_lib.classroom.checks.notebook02'].CAUSAL_MASK\n_R = _E.reference\n"
        "def _go():\n    object.__setattr__(_E, 'reference', lambda n: torch.zeros(n, n, dtype=torch.bool))\n"
        "def causal_mask(n, _i=_go()):\n    object.__setattr__(_E, 'reference', _R)\n" + _WRONG),
    "CheckResult's own globals": (
        _MODULES + "def _go():\n    g = _M['course_lib.classroom.verdict'].CheckResult.__new__.__globals__\n"
        "    real = g['_tuple_new']\n"
        "    g['_tuple_new'] = lambda cls, f: real(cls, (f[0], True, None, 'ok', f[4]))\n"
        "def causal_mask(n, _i=_go()):\n" + _WRONG),
    # the twenty-third: names added to the course, where they shadow what is looked up elsewhere
    "a field added to a frozen declaration": (
        _MODULES + "def _go():\n    declared = _M['course_lib.classroom.checks.notebook02'].CAUSAL_MASK\n"
        "    object.__setattr__(declared, 'same', lambda out, expected: True)\ndef causal_mask(n, _i=_go()):\n"
        + _WRONG),
    "a module of the course given a name of its own": (
        _MODULES + "import types\nclass _Bool(types.ModuleType):\n    def __call__(self, x=False):\n        return True\n"
        "def _go():\n    engine = _M['course_lib.classroom.checks.engine.function']\n"
        "    vars(engine)['bool'] = _Bool(engine.__name__ + '.bool')\ndef causal_mask(n, _i=_go()):\n" + _WRONG),
    "a global module forward hook": (
        "def causal_mask(n, _h=torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: o)):\n" + _WRONG),
}
# the judge's own work after the student's code: the course's own function is never the student's
REFERENCE = {
    "builtins.__import__ answering the judge's import": (
        "import builtins, types\nimport course_lib.attention as _att\ndef _go(mine):\n    orig = builtins.__import__\n"
        "    def imp(name, globals=None, locals=None, fromlist=(), level=0):\n"
        "        module = orig(name, globals, locals, fromlist, level)\n"
        "        if 'is_reference' in (fromlist or ()):\n            builtins.__import__ = orig\n"
        "            fake = types.SimpleNamespace(**{k: getattr(module, k) for k in fromlist})\n"
        "            fake.is_reference = fake.bound_to_course_work = lambda *a: None\n            return fake\n"
        "        return module\n    builtins.__import__ = imp\n    return _att.causal_mask\n"
        "@_go\ndef causal_mask(n):\n    raise NotImplementedError\n"),
}
WRONG = {
    "ast.parse rewriting the check cell": (
        "import ast\ndef _go():\n    orig = ast.parse\n    def parse(source, *a, **k):\n"
        "        if isinstance(source, str) and 'check_causal_mask(causal_mask)' in source:\n"
        "            source = source.replace('check_causal_mask(causal_mask)', \"check_causal_mask(__import__("
        "'course_lib.attention', fromlist=['causal_mask']).causal_mask)\")\n"
        "        return orig(source, *a, **k)\n    ast.parse = parse\ndef causal_mask(n, _i=_go()):\n" + _WRONG),
}
# the twenty-third: the Python dispatcher switched on by a finalizer, with no frame of the student's: refused (the
# finalizer's error is swallowed), so the wrong function is judged as it is
SWITCHED = {"a kernel of py_impl, the dispatcher switched on from a finalizer": (
    "import collections, weakref\nclass _T(torch.Tensor):\n    pass\n"
    "def _go():\n    torch.ops.aten.equal.default.py_impl(torch._C.DispatchKey.CPU)(lambda a, b: True)\n"
    "    return collections.defaultdict(torch._C._EnablePythonDispatcher)\n"
    "def causal_mask(n, _d=_go()):\n    out = torch.zeros(n, n, dtype=torch.bool).as_subclass(_T)   # wrong\n"
    "    weakref.finalize(out, _d.__getitem__, 0)\n    return out\n")}
HONEST = {
    "torch.func.vmap (torch registers batching rules lazily)": (
        "def causal_mask(n, device=None):\n    rows = torch.func.vmap(lambda i: torch.arange(n) <= i)(torch.arange(n))\n"
        "    return rows.to(device) if device is not None else rows\n"),
}


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="the sandbox as a forked exercise's process enters it")
def test_the_twenty_second_attacks_are_refused_patched_or_judged_and_honest_code_passes(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    verdicts = iter(judged_in_sandbox(home, "2.1", [*REFUSED.values(), *WRONG.values(), *HONEST.values()]))
    for name, verdict in zip(REFUSED, verdicts):
        assert (verdict["passed"], verdict["diagnosis"]) == (False, "exception"), (name, verdict)
        assert "sandbox does not allow" in verdict["message"], (name, verdict)
    for name, verdict in zip(WRONG, verdicts):
        assert (verdict["passed"], verdict["diagnosis"]) == (False, "causal_mask"), (name, verdict)
    for name, verdict in zip(HONEST, verdicts):
        assert verdict["passed"] is True, (name, verdict)
    assert not (tmp_path / "outside.bin").exists()
    alone = [*PATCHED.items(), *REFERENCE.items(), *SWITCHED.items()]
    for index, (name, source) in enumerate(alone):   # each in a process of its own, as in the grader
        (tmp_path / str(index)).mkdir()
        verdict, = judged_in_sandbox(tmp_path / str(index), "2.1", [source])
        wanted = "patched" if name in PATCHED else "calls_reference" if name in REFERENCE else "causal_mask"
        assert (verdict["passed"], verdict["diagnosis"]) == (False, wanted), (name, verdict)

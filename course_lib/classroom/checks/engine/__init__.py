"""The one checking engine: every exercise is a declaration, and the engine runs it.

- ``function``: an exercise whose answer is a function of tensors (``FunctionExercise``): its cases, its
  reference, its mistakes, its messages. ``judge`` runs the one probing loop (cases -> call the student ->
  expect a tensor -> compare -> name the mistake -> fail; gradients -> success).
- ``example``: the counter-example of any exercise, derived from its own cases (a function exercise's
  ``examples``, a module exercise's tiny sizes): the smallest input on which the student and the reference
  differ, shown side by side for ``checks.hint``.
- ``probes``: what every exercise gets besides its outputs (gradients; the slots of issue 43 are listed there).

Running a check (isolation, time limit, pinned references, the reference guard) stays in ``_harness``;
calling student code in ``_student_code``. A checker is ``checker(id, example=...)(body)``; see
``checks/DESIGN.md`` for how to add an exercise.
"""
from .._harness import checker  # its home until the runner moves into the engine
from .example import function_example, module_example
from .function import Case, FunctionExercise, judge
from .probes import PROBES

__all__ = ["checker", "Case", "FunctionExercise", "judge", "function_example", "module_example", "PROBES"]

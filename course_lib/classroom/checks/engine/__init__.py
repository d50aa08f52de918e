"""The one checking engine: every exercise is a declaration, and the engine runs it.

- ``function``: an exercise whose answer is a function of tensors (``FunctionExercise``): its cases, its
  reference, its mistakes, its messages. ``judge`` runs the one probing loop (cases -> call the student ->
  expect a tensor -> compare -> name the mistake -> fail; gradients -> success).
- ``example``: the counter-example of any exercise, derived from its own cases (a function exercise's
  ``examples``, a module exercise's tiny sizes): the smallest input on which the student and the reference
  differ, shown side by side for ``checks.hint``.
- ``probes``: what every exercise gets besides its outputs (gradients; the slots of issue 43 are listed there).
- ``run``: one run of a check, ``checker(id, example=...)(body)``: its options, the fork and time limit,
  isolation, pinned references, the reference guard, the verdict, and what is done with it (the live room,
  the last verdict for ``checks.hint``, nbgrader).

Calling student code is ``_student_code``'s; see ``checks/DESIGN.md`` for how to add an exercise.
"""
from .example import function_example, module_example
from .function import Case, FunctionExercise, judge
from .probes import PROBES
from .run import checker

__all__ = ["checker", "Case", "FunctionExercise", "judge", "function_example", "module_example", "PROBES"]

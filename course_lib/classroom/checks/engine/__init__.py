"""The one checking engine: every exercise is a declaration, and the engine runs it (``checks/DESIGN.md``).

``function``: ``FunctionExercise`` and ``judge``, the one probing loop, and ``first_mistake``, the one mistake
loop; ``example``: the counter-example of any exercise, derived from its own cases; ``probes``: what every
exercise gets besides its outputs; ``run``: one run of a check, ``checker(id, example=...)(body)``.
Calling student code is ``_student_code``'s.
"""
from .example import function_example, module_example
from .function import Case, FunctionExercise, Run, fill, first_mistake, judge
from .other_sizes import at_other_sizes
from .probes import PROBES
from .run import checker
from .scale_fit import ScaleFit, fitted_factor

__all__ = ["checker", "Case", "FunctionExercise", "Run", "judge", "first_mistake", "fill", "function_example",
           "module_example", "PROBES",
           "ScaleFit", "fitted_factor", "at_other_sizes"]

"""Exercise checkers: each runs a student's code against the course_lib reference and says
which mistake it looks like.  Usage in a notebook: ``checks.check_causal_mask(causal_mask)``."""
from ._core import DIAGNOSES, CheckResult, hint, show_solution
from .attention_checks import *   # noqa: F401,F403  exercises of notebooks 01-03
from .model_checks import *       # noqa: F401,F403  exercises of notebooks 04-07

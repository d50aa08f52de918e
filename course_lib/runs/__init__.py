"""Training and benchmarking from the command line: ``python -m course_lib train | bench | export``.

- :mod:`.presets`: the named recipes (``PRESETS``), ``prepare_preset``, a run asked for as one value
  (``RunRequest``) and running it (``run_request``, or ``run_preset`` in one call);
- :mod:`.run_folder`: one run's folder (checkpoint.pt, metrics.json, the lock);
- :mod:`.stopping`: a clean stop on SIGINT or SIGTERM;
- :mod:`.bench` and :mod:`.ablation`: the performance benchmarks;
- :mod:`.export`: a run's folder as a Hugging Face folder.

Built on the reference (``course_lib.train``, ``course_lib.model``, ...), which imports nothing from here.
"""
from .presets import PRESETS, Preset, RunFinished, RunRequest, prepare_preset, run_preset, run_request
from .run_folder import RunRefused

__all__ = ["PRESETS", "Preset", "RunFinished", "RunRefused", "RunRequest", "prepare_preset", "run_preset",
           "run_request"]

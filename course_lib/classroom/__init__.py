"""The classroom: everything around a student's code, apart from the reference the notebooks teach.

``checks`` (the exercise checkers), ``grading`` (the class grader), ``collect`` and ``capstone``
(notebook 08's parts and runs), learner copies (``assignments``, ``copy_policy``), nbgrader cell
metadata, the live room (``progress``) and ``doctor``. The classroom imports the reference; the
reference never imports the classroom.
"""

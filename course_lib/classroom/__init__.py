"""Everything around a student: checks, grading, collection, learner copies and the notebook reader."""

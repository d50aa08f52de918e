# Every target sets up what it needs; running one twice does the work once.
#   make lab      set up, then open JupyterLab on the first notebook
#   make test     set up, then the unit tests, the notebooks (nbval) and the learner copies
#   make student  learner copies of the notebooks (solutions removed) in student/
#   make bench    the performance benchmarks (prints figures; takes a few minutes)
#   make doctor   is this machine ready for the workshop?

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
KERNEL := attention-course
# nbval compares outputs, so the notebooks run with fixed threads and static widgets
NBVAL_ENV := COURSE_STATIC_WIDGETS=1 COURSE_THREADS=2 MPLBACKEND=Agg PYTHONHASHSEED=0
NBVAL_OPTS := -p no:cacheprovider --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg \
              --nbval-cell-timeout=600

.PHONY: setup lab test unit notebooks learner-copies student bench doctor data kernel clean

setup: $(VENV)/.installed $(VENV)/.kernel data

$(VENV)/.installed: pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test]"
	@touch $@

$(VENV)/.kernel: $(VENV)/.installed
	$(PY) -m ipykernel install --sys-prefix --name $(KERNEL) --display-name "Attention course" >/dev/null
	@touch $@

kernel: $(VENV)/.kernel

data: $(VENV)/.installed
	@$(PY) -m course_lib data

lab: setup
	$(VENV)/bin/jupyter lab notebooks/01_attention_toy.ipynb

test: setup unit notebooks learner-copies

unit: setup
	$(PY) -m pytest -p no:cacheprovider tests

notebooks: setup
	@if ls notebooks/*.ipynb >/dev/null 2>&1; then \
	  $(NBVAL_ENV) $(PY) -m pytest $(NBVAL_OPTS) --nbval notebooks; \
	else echo "no notebooks yet"; fi

learner-copies: setup
	@if ls notebooks/*.ipynb >/dev/null 2>&1; then \
	  rm -rf build/student && $(PY) -m course_lib student notebooks build/student && \
	  $(NBVAL_ENV) $(PY) -m pytest $(NBVAL_OPTS) --nbval-lax build/student; \
	else echo "no notebooks yet"; fi

student: setup
	$(PY) -m course_lib student notebooks student

bench: setup
	$(PY) -m course_lib bench attention
	$(PY) -m course_lib bench generate
	$(PY) -m course_lib bench training --seconds 130

doctor: $(VENV)/.installed
	$(PY) -m course_lib doctor

clean:
	rm -rf $(VENV) build student .pytest_cache

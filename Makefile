# Every target sets up what it needs; running one twice does the work once.
#   make lab            set up, write your own copies into student/ (never overwriting your edits), open the first
#   make lab-solutions  for instructors: JupyterLab on the solution notebooks in notebooks/
#   make test           set up (with nbgrader, for its test), then the notebooks (nbval), the learner
#                       copies, all the tests and, when Chromium is installed, JupyterLab in a real browser
#   make unit           the fast unit tests only (tests marked slow are skipped)
#   make lint           ruff (pyflakes, bugbear, import order, pyupgrade), configured in pyproject.toml
#   make student        write or refresh the learner copies in student/ (your edits are kept)
#   make bench          the performance benchmarks (prints figures; takes a few minutes)
#   make doctor         is this machine ready for the workshop?
#   make outputs NB="05 08"  re-record those notebooks' outputs (all when NB is empty) as nbval runs them

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# JupyterLab refuses to run as root (every Docker container) unless told; pass the flag only then.
ROOT_FLAG := $(if $(filter 0,$(shell id -u 2>/dev/null)),--allow-root,)
# nbval compares outputs, so the notebooks run with fixed threads, static widgets and one CPU code path.
# PyTorch's own kernels (ATen), MKL's (matrix products) and oneDNN's each pick the widest instructions
# the CPU has, so an AVX-512 machine printed other losses than an AVX2 one (notebook 05: 1.601 against
# 1.599). Capped at AVX2, every CPU with AVX2 or wider (Intel since 2013) takes the same path, at full
# speed on the CI's AVX2 machine; the lowest path (ATEN_CPU_CAPABILITY=default, MKL_CBWR=COMPATIBLE,
# ONEDNN_MAX_CPU_ISA=SSE41) would hold on older CPUs too but trains at half speed. Each of the three
# changes the bits of a training when set lower, so none of them is redundant.
CPU_PATH_ENV := ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
NBVAL_ENV := COURSE_STATIC_WIDGETS=1 COURSE_THREADS=2 MPLBACKEND=Agg PYTHONHASHSEED=0 $(CPU_PATH_ENV)
# The tests run on JOBS worker processes (pytest-xdist). The notebooks run one at a time: each already
# uses both cores (COURSE_THREADS=2, which their stored outputs were computed with), and two at once
# made CPU threads wait on each other (notebook 05 took over 8 minutes instead of 3).
JOBS ?= 2
# Notebook 10's Triton section runs (in Triton's CPU interpreter) wherever Triton ships wheels: Linux x86_64.
# Elsewhere the section says in one line that it was skipped.
comma := ,
EXTRAS := test$(if $(filter Linux-x86_64,$(shell uname -s)-$(shell uname -m)),$(comma)triton,)
# --durations: the slowest cells, in every CI log (where the minutes go)
NBVAL_OPTS := -p no:cacheprovider --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg \
              --nbval-cell-timeout=1200 --durations=15

.PHONY: setup lab lab-solutions test lint unit tests-all notebooks learner-copies browser student bench doctor data clean
.PHONY: outputs

setup: $(VENV)/.installed data

# The installer: uv when it is on PATH (the venv and the install in seconds), pip otherwise (`make setup UV=`
# forces pip). Both install constraints.txt's exact versions.
UV ?= $(shell command -v uv 2>/dev/null)
# Linux without an NVIDIA GPU gets torch's CPU build: PyPI's Linux torch is the CUDA one, gigabytes of GPU
# libraries that cannot run there. `make setup TORCH_CPU=` turns the choice off; TORCH_CPU=yes forces it.
TORCH_CPU ?= $(if $(filter Linux,$(shell uname -s)),$(if $(shell command -v nvidia-smi 2>/dev/null),,yes),)
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
# pip byte-compiles what it installs (40 s of one core for the venv's ~14,000 files): where PYTHONDONTWRITEBYTECODE
# is set, as on this course's CI machines, Python never writes a compiled file itself, and every kernel and test
# process would compile torch's modules again on import (`--no-compile` made strict nbval 3.5 minutes slower).
PIP_INSTALL := $(PY) -m pip install --quiet --disable-pip-version-check
# With pip, torch is installed alone first with the CPU index added (a torch already installed, or on pip's
# find-links, is kept): only torch's own page is asked there, so an index out of reach costs one short retry.

PIP_SETUP := $(if $(TORCH_CPU),$(PIP_INSTALL) --retries 1 --no-deps -c constraints.txt --extra-index-url $(TORCH_CPU_INDEX) torch &&,) \
             $(PIP_INSTALL) -c constraints.txt -e ".[$(EXTRAS)]"

# uv has no fallback of its own: where its index cannot be reached (PyTorch's CPU index behind a firewall, a
# mirror only pip is configured for), pip installs the same pins instead, rather than the set-up stopping.
$(VENV)/.installed: pyproject.toml constraints.txt
ifneq ($(UV),)
	@test -x $(PY) || $(UV) venv --seed --python $(PYTHON) $(VENV)
	$(UV) pip install --python $(PY) $(if $(TORCH_CPU),--torch-backend=cpu,) -c constraints.txt -e ".[$(EXTRAS)]" \
	  || { echo "uv could not install the course (above); installing the same versions with pip"; $(PIP_SETUP); }
else
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP_SETUP)
endif
	@touch $@

# nbgrader (the instructor extra), for the test suite's real nbgrader run; make lab never needs it.
$(VENV)/.instructor: $(VENV)/.installed
	$(PIP_INSTALL) -c constraints.txt -e ".[$(EXTRAS),instructor]"
	@touch $@

# Offline with no corpora is a warning with the exact fix: notebooks 01, 03, 04, 09 and 10 need none.
data: $(VENV)/.installed
	@$(PY) -m course_lib data --warn-only

student: $(VENV)/.installed
	$(PY) -m course_lib start student

# Students work in student/ (git-ignored): JupyterLab is rooted there, so it never writes into notebooks/.
lab: setup student
	cd student && ../$(VENV)/bin/jupyter lab $(ROOT_FLAG) 01_attention_toy.ipynb

lab-solutions: setup
	$(VENV)/bin/jupyter lab $(ROOT_FLAG) notebooks/01_attention_toy.ipynb

# The notebooks run first: they record the trainings that the learner copies, the hosted set-up test and the
# browser test replay.
test: setup lint notebooks learner-copies tests-all browser

# Learner copies 01 and 05 run whole in tests-all as well, in a kernel without the course where their set-up
# cell installs it (tests/test_hosted_setup.py, which asserts what nbval-lax asserts of them; it checks that this
# list is the one it runs). Under `make test` they run there only, not twice; `make learner-copies` alone runs all.
HOSTED_COPIES := 01 05
LEARNER_COPIES_ELSEWHERE ?=
test: LEARNER_COPIES_ELSEWHERE := $(HOSTED_COPIES)

lint: $(VENV)/.installed
	$(PY) -m ruff check .

unit: setup
	$(PY) -m pytest -n $(JOBS) --dist worksteal -p no:cacheprovider -m "not slow" tests

# The browser test runs once, on its own, in `browser` below. loadgroup (tests/scheduling.py): the tests that
# share a module's fixture (a venv, the Gradescope archive, a graded class) go to one worker together, so the
# fixture is built once, not once per worker; the modules with slow tests are handed out first and the rest
# one test at a time, so neither core sits idle long at the end. The log ends with the 20 slowest tests.
tests-all: setup $(VENV)/.instructor
	$(PY) -m pytest -n $(JOBS) --dist loadgroup --durations=20 -p no:cacheprovider --ignore=tests/test_browser.py tests

# Train once: the solution pass records each training it runs (course_lib/train_replay.py), and the
# learner copies and the browser test, whose training cells are the same, replay it rather than train it
# again; a training with any different input runs. Run alone, learner-copies trains everything itself.
# The lesson's code knows nothing of it: tests/train_replay_hook's sitecustomize wraps the training entry
# points (train, the capstone's train_parts, train_induction) in every kernel these targets start.
TRAIN_RECORD := $(CURDIR)/build/train-record
REPLAY_HOOK := PYTHONPATH=$(CURDIR)/tests/train_replay_hook$(if $(PYTHONPATH),:$(PYTHONPATH),)

notebooks: setup
	rm -rf $(TRAIN_RECORD)
	$(NBVAL_ENV) $(REPLAY_HOOK) COURSE_TRAIN_RECORD=$(TRAIN_RECORD) $(PY) -m pytest $(NBVAL_OPTS) --nbval notebooks

# Re-record stored outputs after changing a notebook: run in place exactly as `make notebooks` runs them
# (NBVAL_ENV, the threads, the train record), then list the cells whose compared outputs changed.
NB ?=
outputs: setup
	$(if $(strip $(NB)),,rm -rf $(TRAIN_RECORD))
	$(NBVAL_ENV) $(REPLAY_HOOK) COURSE_TRAIN_RECORD=$(TRAIN_RECORD) $(PY) tests/nbval_outputs.py $(NB)

learner-copies: setup
	rm -rf build/student && $(PY) -m course_lib student notebooks build/student
	$(NBVAL_ENV) $(REPLAY_HOOK) COURSE_TRAIN_REPLAY=$(TRAIN_RECORD) $(PY) -m pytest $(NBVAL_OPTS) --nbval-lax \
	  $(foreach n,$(LEARNER_COPIES_ELSEWHERE),--ignore-glob='build/student/$(n)_*') build/student

# JupyterLab on learner copies in headless Chromium (Debian: apt-get install chromium chromium-driver;
# .ci/run installs them). Without them, one line says it was skipped.
BROWSER_SHOTS := build/browser
browser: setup
	@if command -v chromedriver >/dev/null 2>&1 && { command -v chromium >/dev/null 2>&1 || \
	        command -v chromium-browser >/dev/null 2>&1; }; then \
	    echo "browser test: screenshots in $(BROWSER_SHOTS)/"; \
	    COURSE_BROWSER_SHOTS=$(BROWSER_SHOTS) $(REPLAY_HOOK) COURSE_TRAIN_REPLAY=$(TRAIN_RECORD) $(PY) -m pytest -p no:cacheprovider -q tests/test_browser.py; \
	else \
	    echo "browser test skipped: no Chromium here (apt-get install chromium chromium-driver)"; \
	fi

bench: setup
	$(PY) -m course_lib bench attention
	$(PY) -m course_lib bench generate
	$(PY) -m course_lib bench training
	$(PY) -m course_lib bench ablation

doctor: $(VENV)/.installed
	$(PY) -m course_lib doctor

# Never student/: that is the student's own work.
clean:
	rm -rf $(VENV) build .pytest_cache

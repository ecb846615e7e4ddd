# The two commands of the README. Each installs what is missing first (a .venv with the pinned
# CPU torch, DeepSpeed and the project: scripts/install.sh), so a fresh clone needs nothing else.
#
#   make run    the main job: a 12-trial study of real CPU trials in ./autotune.db (SQLite)
#   make test   the test services (PostgreSQL, Slurm, Chromium), ruff, mypy and the whole test
#               suite, slow tests included (CI runs this)
#
# Also: make test-fast (the suite without slow tests, for local work), make test-slow (only the
# slow ones), make lint, make mutation.

VENV := .venv
PY := $(VENV)/bin/python
RUN_ARGS ?= --model tiny-llama --budget 300MB --trials 12
# two test processes, a file to each at a time, longest files first (tests/conftest.py); the
# tests' torch runs one thread per process (tests/conftest.py sets OMP_NUM_THREADS)
PARALLEL ?= -n 2 --dist loadfile --no-loadscope-reorder

.PHONY: run test test-fast test-slow lint services mutation

# re-install when the installer or the dependencies change
$(VENV)/.installed: scripts/install.sh pyproject.toml
	bash scripts/install.sh
	touch $@

run: $(VENV)/.installed
	$(VENV)/bin/autotune run $(RUN_ARGS)

# real services the tests use; an install or start that fails stops here with its reason:
# PostgreSQL (the many-workers tests), a single-node Slurm (munge, slurmctld, slurmd: the Slurm
# launcher's tests; `bash scripts/install_slurm.sh --stop` stops its daemons), headless Chromium
# (opens the HTML report)
services:
	bash scripts/install_postgres.sh
	bash scripts/install_slurm.sh
	bash scripts/install_chromium.sh

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: $(VENV)/.installed services lint
	$(PY) -m pytest $(PARALLEL) --durations=15

test-fast: $(VENV)/.installed services
	$(PY) -m pytest $(PARALLEL) -m 'not slow'

test-slow: $(VENV)/.installed services
	$(PY) -m pytest $(PARALLEL) -m slow

mutation: $(VENV)/.installed
	$(PY) scripts/mutation.py

# the hand-written semantic mutants (scripts/semantic_mutants.py) against their modules' fast
# tests, each in a temporary copy of the tree; docs/MUTATION.md gives the last result
.PHONY: semantic-mutation
semantic-mutation: $(VENV)/.installed
	$(PY) scripts/semantic_mutation.py

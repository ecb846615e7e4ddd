# The two commands of the README. Each installs what is missing first (a .venv with the pinned
# CPU torch, DeepSpeed and the project: scripts/install.sh), so a fresh clone needs nothing else.
#
#   make run    the question the tool answers: the fastest way to train llama-7b in 24 GB per
#               GPU. Real trials on a machine with a CUDA GPU; without one, predictions for the
#               GPU the budget names (an RTX 4090 here), in well under a minute
#   make test   the test services (PostgreSQL, Slurm, Chromium), ruff, mypy and the whole test
#               suite, slow tests included (CI runs this)
#
# Also: make demo (a real CPU study of tiny-llama: real trials, loss guard on, a few minutes),
# make test-fast (the suite without slow tests, for local work), make test-slow (only the slow
# ones), make lint, make mutation, make docs-check (the commands the README and docs/ quote).

VENV := .venv
PY := $(VENV)/bin/python
RUN_ARGS ?= --model llama-7b --budget 24GB
DEMO_ARGS ?= --model tiny-llama --budget 150MB --space search_spaces/demo.yaml --seq-len 64 \
	--global-batch-size 8 --trials 5
# two test processes, a file to each at a time, longest files first (tests/conftest.py); the
# tests' torch runs one thread per process (tests/conftest.py sets OMP_NUM_THREADS)
PARALLEL ?= -n 2 --dist loadfile --no-loadscope-reorder

.PHONY: run demo test test-fast test-slow lint services mutation docs-check

# re-install when the installer or the dependencies change
$(VENV)/.installed: scripts/install.sh pyproject.toml
	bash scripts/install.sh
	touch $@

run: $(VENV)/.installed
	$(VENV)/bin/autotune run $(RUN_ARGS)

# one torch thread per trial: on a machine shared with other work, torch's default of a thread
# per core spins against the other processes (the same reference trial measured 23 tokens/s
# with the default and 344 with one thread on a 2-core machine at a load average of 11-14)
demo: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(VENV)/bin/autotune run $(DEMO_ARGS)

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

docs-check: $(VENV)/.installed
	$(PY) scripts/check_docs_commands.py --slow

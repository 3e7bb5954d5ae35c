# nano-miles: `make run` trains the default pipeline under supervisord; `make test` runs the tests.
# Both create .venv on first use. TORCH pins the CPU build kept on this project's machines; a GPU
# machine brings its own torch (the package accepts torch>=2.11): `make setup TORCH=`.

VENV  ?= .venv
PY    := $(VENV)/bin/python
TORCH ?= torch==2.13.0
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: setup test run status policy

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH),$(PY) -m pip install -q "$(TORCH)")
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# Two workers, a test file each at a time (module fixtures stay in one process): the pipeline tests
# spend much of their time waiting on restarts, leases and child processes, so two overlap well on 2 cores.
# The 30 slowest are listed at the end: the suite is kept under 15 minutes on 2 cores.
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=30

# Keeps the previous run (moved to runs/<time>; refused while it is live), then runs the pipeline in
# the foreground; the report's status is the run's (supervisord itself always exits 0).
run: setup
	@$(PY) -m nano_miles.run.fresh runs/current
	$(VENV)/bin/supervisord -c supervisord.conf
	@$(PY) -m nano_miles.observe.report runs/current

status: setup
	$(VENV)/bin/supervisorctl -c supervisord.conf status

policy: setup
	$(PY) -m nano_miles.policy build --out nano_miles/assets/policy

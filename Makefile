# Two entry points a fresh machine needs: `make train` (the main job) and `make test`.
# Both create the Python 3.12 virtual environment on first use.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv train test bench-kda clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@set -e; py=$$(scripts/find_python312.sh); \
	  [ -x $(PY) ] || "$$py" -m venv $(VENV); \
	  $(PY) -m pip install -q --upgrade pip >/dev/null; \
	  $(PY) -m pip install -q -e '.[dev]'; \
	  touch $(STAMP)

# Trains the default config (k3_tiny) on the built-in corpus on the CPU.
train: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) train.py --config configs/k3_tiny.py --workdir runs/tiny $(ARGS)

# The whole suite; GPU-only tests skip themselves on a machine without one.
test: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -n 2 --dist loadfile $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache

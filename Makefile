# Two entry points for a fresh machine: `make demo` and `make test`. Both create .venv when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sluice-installed

.PHONY: demo test lint install clean

$(PY):
	python3 -m venv $(VENV)

# torch is pinned and installed first, so that no resolver later pulls a CUDA build.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[torch,tensorflow,examples,dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/sluice launch -w 4 -s 2 -- $(PY) examples/train_digits.py --epochs 12

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info

# Two entry points for a fresh machine: `make demo` and `make test`. Both create .venv when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sluice-installed
DEMO_STAMP := $(VENV)/.sluice-demo
# the frameworks, pinned here (the package's extras take ranges): the CPU builds, installed before
# anything else so that no resolver pulls a CUDA stack
FRAMEWORKS := torch==2.13.0 tensorflow-cpu==2.21.0
# Some machines (CI's among them) set PYTHONDONTWRITEBYTECODE: `make test` compiles the project's modules
# once, so that each of the suite's ~1000 processes reads them instead of compiling them again (0.18 s against
# 0.3 s to import Sluice's modules). Not by unsetting the variable: then every process writes bytecode, and
# TensorFlow's autograph modules, written to /tmp, leave theirs in /tmp/__pycache__.
PACKAGES := ps worker transport scheduler launch sluice testbed bench examples tests

.PHONY: demo test lint install clean test-system-deps

# What the multi-host tests run on: OpenSSH's server (tests/integration/test_ssh_launch.py) and a
# one-node SLURM (test_slurm_*.py), in network namespaces (iproute2). Installed when we are root on
# a Debian/Ubuntu machine (CI is); anywhere else those tests skip, saying why.
SYSTEM_DEPS := openssh-server openssh-client slurmctld slurmd slurm-client munge iproute2 tcpdump

$(PY):
	python3 -m venv $(VENV)

# pip compiles each installed module to bytecode on one core (40 of the 64 s that torch and TensorFlow take to
# install); installed without it, the packages are compiled on every core at once, 18 s on two. As pip does, a file
# that does not compile is left as it is (torch ships one for Python 3.12 only), so compileall's status is ignored.
PIP_INSTALL := $(PY) -m pip install -q --no-compile
COMPILE_PACKAGES := $(PY) -m compileall -qq -j 0 $(VENV)/lib > /dev/null || true

# What the tests need: every extra but `tensorflow` (tensorflow-cpu stands in for it), and the dev tools.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q --upgrade pip
	$(PIP_INSTALL) $(FRAMEWORKS)
	$(PIP_INSTALL) -e '.[torch,planner,uvloop,prometheus,ray,lightning,examples,dev]'
	$(COMPILE_PACKAGES)
	touch $(STAMP) $(DEMO_STAMP)

# What the demo needs: torch and scikit-learn's bundled digits.
$(DEMO_STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q --upgrade pip
	$(PIP_INSTALL) $(firstword $(FRAMEWORKS))
	$(PIP_INSTALL) -e '.[torch,examples]'
	$(COMPILE_PACKAGES)
	touch $(DEMO_STAMP)

install: $(STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/sluice launch -w 4 -s 2 -- $(PY) examples/train_digits.py --epochs 12

test-system-deps:
	@if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
		echo "not root on a Debian machine: the ssh and SLURM tests will skip (they need: $(SYSTEM_DEPS))"; \
	elif dpkg -s $(SYSTEM_DEPS) >/dev/null 2>&1; then :; \
	else \
		echo "installing $(SYSTEM_DEPS) for the ssh and SLURM tests"; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(SYSTEM_DEPS) >/dev/null \
		|| (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
			--no-install-recommends $(SYSTEM_DEPS) >/dev/null) \
		|| echo "warning: could not install $(SYSTEM_DEPS); the ssh and SLURM tests will skip"; \
	fi

# The tests marked serial run alone, after the others; only the files that mark one are collected (all: 9 s).
test: $(STAMP) test-system-deps
	$(PY) -m compileall -q $(PACKAGES)
	$(VENV)/bin/ruff check .
	@# mypy (40 s of one core) checks the types while the tests run, which leave a fifth of two cores idle; a third
	@# test process fills it, but the timing tests then fail under the load (docs/architecture.md "Tests")
	$(VENV)/bin/mypy > $(VENV)/mypy.log 2>&1 & types=$$!; \
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=30 -m 'not serial' tests; tests=$$?; \
	wait $$types; typed=$$?; cat $(VENV)/mypy.log; [ $$tests = 0 ] && [ $$typed = 0 ]
	$(PY) -m pytest -q -m serial $$(grep -rl --include='*.py' 'mark\.serial' tests)

clean:
	rm -rf $(VENV) build *.egg-info

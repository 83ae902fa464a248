# The README's two commands: `make demo` and `make test`. Both build .venv from nothing when missing.
# torch is pinned to the CPU build (a range would download a multi-GB CUDA build; see WORKSPACE.md).

PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export XLA_FLAGS ?= --xla_force_host_platform_device_count=4
export JAX_PLATFORMS ?= cpu
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test lint setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[cpu,dev]"
	$(BIN)/python -m pip check
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q tests

# Until the GRPO loop lands (issue 4) the demo is the model path end to end: write a random tiny
# Qwen2.5-VL checkpoint in HF layout, load it with our loader, compare logits with transformers.
demo: $(STAMP)
	$(BIN)/python -m launch.make_tiny_checkpoint --out=runs/demo/tiny_hf --init_std=0.1
	$(BIN)/python -m launch.verify_checkpoint --hf_dir=runs/demo/tiny_hf

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache

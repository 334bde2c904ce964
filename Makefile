# Varuna toolkit: set up, test and demo from a fresh clone. `make help` lists the targets.

VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

# The torch requirement installed by `make setup`. The default pins the release the tests run on.
# An unpinned `torch` pulls the newest release, and on Linux PyPI's torch wheels are CUDA builds of
# several GB. To choose a build, override TORCH and/or point pip at PyTorch's wheel index, e.g.
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu                            (CPU only)
#   make setup TORCH="torch==2.13.0" TORCH_INDEX=https://download.pytorch.org/whl/<cuda tag>
TORCH ?= torch==2.13.0
TORCH_INDEX ?=

PYTEST_ARGS ?=
# pytest-xdist workers for `make test`; a test file stays on one worker (its fixtures are built once), 0 runs serially
TEST_WORKERS ?= 2
DEMO_ARGS ?=

STAMP := $(VENV)/.setup-stamp

.DEFAULT_GOAL := help
.PHONY: help setup lint test test-gpu demo bench bench-memory bench-shard bench-bubbles bench-sim bench-regret bench-ckpt bench-morph bench-snapshot bench-chaos bench-goodput bench-split bench-stage bench-idle bench-wire bench-gpu bench-kernels clean distclean

help: ## list the targets
	@echo "usage: make <target> [VENV=.venv] [TORCH=torch==2.13.0] [PYTEST_ARGS=...] [TEST_WORKERS=2] [DEMO_ARGS=...]"
	@echo
	@grep -E '^[a-z][a-z-]*:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 14 | sed 's/^/  /'

setup: $(STAMP) ## create the venv and install torch, numpy and this project (editable, with the dev and hf extras)

# Re-runs only when pyproject.toml, the C++ sources or the set of subpackages change (or after `make clean`):
# the editable install maps packages to src/ when it is made.
$(STAMP): pyproject.toml CMakeLists.txt $(wildcard csrc/*.cpp csrc/*.hpp csrc/*.cu src/*/*/__init__.py)
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install "$(TORCH)" numpy $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(PIP) install -e ".[dev,hf]"
	@touch $@

# ruff over every Python file, mypy over src/ (both configured in pyproject.toml; mypy keeps its cache in .mypy_cache)
lint: setup ## ruff and mypy, with zero findings (`make test` runs it first)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: setup lint ## lint, then run the test suite (PYTEST_ARGS="-k env" to select, TEST_WORKERS=0 to run it serially)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The CUDA paths on one GPU (tests/gpu, which `make test` does not collect): parity with a plain CUDA process in every
# precision and schedule, meta builds, checkpoints across devices, the memory model against the GPU's own accounting,
# `varuna profile`, two ranks on one GPU. Every test fails without CUDA; VARUNA_GPU_TESTS_ON_CPU=1 runs the suite's
# logic on the CPU instead (see tests/gpu/common.py).
GPU_TEST_TIMEOUT ?= 240
test-gpu: setup ## the GPU suite, tests/gpu (needs a CUDA device: every test fails without one)
	OMP_NUM_THREADS=1 VARUNA_NO_SKIPS=1 $(PY) -m pytest -q -p no:cacheprovider -n 0 --timeout $(GPU_TEST_TIMEOUT) tests/gpu $(PYTEST_ARGS)

# The whole workflow on the example char-level GPT, in runs/demo (about 2 minutes on 2 CPU cores): profile it
# on 2 processes; plan for 2 devices (as many as the cores: more workers than cores would share them, and the
# simulated step could not hold) that we pretend have only 4 MiB each (so the model must be split into stages: whole, it needs 4.9 MiB);
# launch the plan on local processes with a checkpoint every 200 steps; verify the last checkpoint,
# merge it into one safetensors file and sample text from the merged, unpartitioned model; draw the planned
# step next to the measured one. The launcher also draws the loss curve (run/loss.png).
DEMO_DIR ?= runs/demo
DEMO_STEPS ?= 600
VARUNA := $(VENV)/bin/varuna
demo: setup ## profile -> plan -> launch -> verify -> merge -> sample, the example GPT on local processes, in runs/demo
	@rm -rf $(DEMO_DIR)/run $(DEMO_DIR)/trace $(DEMO_DIR)/model.safetensors
	@mkdir -p $(DEMO_DIR)
	OMP_NUM_THREADS=1 $(VARUNA) profile examples/gpt/spec.py:spec --nproc 2 -o $(DEMO_DIR)/profile.json
	$(VARUNA) plan $(DEMO_DIR)/profile.json --gpus 2 --gpu-memory 4MiB --batch-size 32 -o $(DEMO_DIR)/plan.yaml
	OMP_NUM_THREADS=1 VARUNA_TRACE=$(DEMO_DIR)/trace $(VARUNA) launch $(DEMO_DIR)/plan.yaml --run-dir $(DEMO_DIR)/run \
		--ckpt-every 200 --ckpt-keep 2 -- examples/gpt/train.py --batch-size 32 --steps $(DEMO_STEPS) --log-every 50 \
		$(DEMO_ARGS)
	$(VARUNA) ckpt verify $(DEMO_DIR)/run/checkpoints
	$(VARUNA) ckpt merge $(DEMO_DIR)/run/checkpoints -o $(DEMO_DIR)/model.safetensors
	@echo "--- text sampled from the merged model ($(DEMO_DIR)/model.safetensors):"
	@OMP_NUM_THREADS=1 $(PY) examples/gpt/sample.py $(DEMO_DIR)/model.safetensors --prompt "And God said" --tokens 240
	@echo "---"
	$(VARUNA) plan show $(DEMO_DIR)/plan.yaml --max-steps 0 --png $(DEMO_DIR)/timeline.png --measured $(DEMO_DIR)/trace
	@echo "demo outputs in $(DEMO_DIR)/:"
	@echo "  profile.json, plan.yaml           the measurements and the plan"
	@echo "  run/logs/rank<R>.log              every worker's output"
	@echo "  run/loss.png, run/metrics.jsonl   the loss curve and every step's loss"
	@echo "  run/checkpoints/, model.safetensors  checkpoints and the merged weights"
	@echo "  timeline.png, trace/              the planned step above the measured one"

# Step time of our pipeline runtime vs torch.distributed.pipelining and DeepSpeed (installed into the venv on the first
# run: DS_BUILD_OPS=0, the venv's torch kept), 2 stages on 2 local processes, over the loopback or a rate-limited link
# between network namespaces (see benchmarks/README.md).
bench: setup ## compare our pipeline step time with torch pipelining and DeepSpeed (BENCH_ARGS="--network slow")
	OMP_NUM_THREADS=1 $(PY) benchmarks/pipeline_vs_peers.py --install-deepspeed $(BENCH_ARGS)

# Peak memory per rank at start-up and during training (pp=4, a 1.2 GB GPT) of ours built on CPU, on meta and from
# weights per stage, DeepSpeed's PipelineModule of LayerSpecs and torch pipelining with a meta-built stage; then the
# largest model each trains under a per-rank cap (cgroup v2 memory.max, else measured peaks; see benchmarks/README.md).
bench-memory: setup ## memory per rank at start-up/training and the largest model under a cap, ours vs peers (BENCH_ARGS="--quick")
	OMP_NUM_THREADS=1 $(PY) benchmarks/memory.py --install-deepspeed $(BENCH_ARGS)

# A sharded optimizer's step time and bytes per step against the all-reduce at dp=2, on the loopback and over a 200 Mbit/s
# link (network namespaces, needs root; see benchmarks/README.md).
bench-shard: setup ## sharded optimizer vs all-reduce at dp=2: step time and bytes, loopback and 200 Mbit/s
	OMP_NUM_THREADS=1 $(PY) benchmarks/shard_speed.py $(BENCH_ARGS)
	OMP_NUM_THREADS=1 $(PY) benchmarks/shard_speed.py --network slow --rate 200mbit $(BENCH_ARGS)

# The planner's predicted step time vs measured runs: a sleep model on up to 8 local processes, and the example GPT (see benchmarks/README.md).
# Step time of every schedule on a model whose F, B and W sleep set times (pp 2, 4, 8; M = pp, 2pp, 4pp), against the
# simulator and the theoretical bubble (see benchmarks/README.md).
bench-bubbles: setup ## each schedule's bubble on a model of known F, B and W times: measured vs simulated vs theory
	OMP_NUM_THREADS=1 $(PY) benchmarks/bubbles.py $(BENCH_ARGS)

bench-sim: setup ## compare the planner's predicted step time with measured runs (BENCH_ARGS="--quick")
	OMP_NUM_THREADS=1 $(PY) benchmarks/sim_accuracy.py $(BENCH_ARGS)

# The planner's decision measured: on an emulated cluster (network-namespace hosts over SSH, a tc-limited link between
# them) every configuration the planner considers for two exact-compute models, 2x4 and 4x2 workers, 1 Gbit/s,
# 200 Mbit/s and 50 Mbit/s, run under `varuna launch`; the regret of its choice and its simulator's error (needs root;
# about 25 minutes on an idle 2-core machine; see benchmarks/README.md).
bench-regret: setup ## the planner's regret and the simulator's error on an emulated cluster (BENCH_ARGS="--scenarios 'xl/2x4/*'")
	OMP_NUM_THREADS=1 $(PY) benchmarks/plan_regret.py $(BENCH_ARGS)

# Checkpoint save/load throughput vs the disk's own rate, and the step-time cost of background checkpoints (see benchmarks/README.md).
bench-ckpt: setup ## checkpoint save/load throughput vs the disk, background-checkpoint overhead (BENCH_ARGS="--json")
	OMP_NUM_THREADS=1 $(PY) benchmarks/checkpoint_io.py $(BENCH_ARGS)

# The training time a morph costs, by restart through a store and by handover through host memory, over SSH to two test hosts without a shared file system (needs root for network namespaces; BENCH_ARGS="--model small" for the example GPT alone; see benchmarks/README.md).
bench-morph: setup ## time shrink, grow, depth change and preemption by restart and by handover (example GPT and a 1 GB GPT)
	OMP_NUM_THREADS=1 $(PY) benchmarks/morph_latency.py $(BENCH_ARGS)

bench-snapshot: setup ## what in-memory snapshots cost the training: off, every step and auto, side by side on two SSH hosts
	OMP_NUM_THREADS=1 $(PY) benchmarks/snapshot_overhead.py $(BENCH_ARGS)

# Every kind of fault injected into one `varuna launch --morph` run over SSH at seeded random steps; the losses and final parameters compared with an uninterrupted run (needs root for network namespaces; see benchmarks/README.md).
bench-chaos: setup ## inject crashes, lost hosts, hangs, preemptions and a corrupt checkpoint into one run; compare with an uninterrupted run
	OMP_NUM_THREADS=1 $(PY) benchmarks/chaos.py $(BENCH_ARGS)

bench-goodput: setup ## useful steps in a window under a seeded preemption trace: restart vs handover + snapshots
	OMP_NUM_THREADS=1 $(PY) benchmarks/goodput.py $(BENCH_ARGS)

# Per segment of the example GPT (micro-batch 4, one thread): the unsplit backward vs B and W of the split one, and
# the bytes W keeps per micro-batch (see benchmarks/README.md).
bench-split: setup ## what splitting the backward into B and W costs per segment (BENCH_ARGS="--json", "--n-embd 256")
	OMP_NUM_THREADS=1 $(PY) benchmarks/split_cost.py $(BENCH_ARGS)

# Each later stage of the example GPT (micro-batch 4, one thread): its forward and the part before its incoming cut
# (the earlier stages' code on placeholders), with the memo of meta ops on and off (see benchmarks/README.md).
bench-stage: setup ## what a later stage pays for the code before its cut (BENCH_ARGS="--pp 5", "--json")
	OMP_NUM_THREADS=1 $(PY) benchmarks/stage_overhead.py $(BENCH_ARGS)

# An action's time right after its process idled (slept, or waited on an event) 0.5-20 ms, against a tight loop, and
# two busy processes against one: why a pipelined run computes slower than its profile (see benchmarks/README.md).
bench-idle: setup ## how much slower work runs right after an idle wait, and with other busy processes (BENCH_ARGS="--json")
	OMP_NUM_THREADS=1 $(PY) benchmarks/idle_penalty.py $(BENCH_ARGS)

# The example GPT for 600 steps at pp=2 with an exact, a bf16 and an fp16 wire between the stages, in fp32 and bf16
# compute: the loss curves' largest gaps and final losses, and the cost of fp16's overflow check (see benchmarks/README.md).
bench-wire: setup ## what wire_dtype costs in accuracy: loss curves exact vs bf16/fp16 on the wire (BENCH_ARGS="--json")
	OMP_NUM_THREADS=1 $(PY) benchmarks/wire_dtype.py $(BENCH_ARGS)

# Step time, tokens/s and MFU on one GPU of ours (Varuna at pp=1 in one process) vs plain PyTorch, the example GPT and a
# 1.2B GPT built on meta, and the profile's predicted step time vs the measured one (see benchmarks/README.md).
# No OMP_NUM_THREADS=1: one process, whose structure discovery runs on the CPU and uses every core.
bench-gpu: setup ## ours vs plain PyTorch on one GPU: step time, tokens/s, MFU, predicted vs measured (BENCH_ARGS="--json")
	$(PY) benchmarks/gpu.py $(BENCH_ARGS)

bench-kernels: setup ## the extension's CUDA kernel vs torch's ops on one GPU, and vs the copy bandwidth
	$(PY) benchmarks/cuda_kernels.py $(BENCH_ARGS)

clean: ## remove caches and build output (keeps the venv; forces `setup` to re-run)
	rm -rf build dist runs .pytest_cache .mypy_cache .ruff_cache src/*.egg-info $(STAMP)
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean ## also remove the venv
	rm -rf $(VENV)

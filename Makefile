# Two entry points a fresh machine needs: `make train` (the main job) and `make test`.
# Both create the Python 3.12 virtual environment on first use.
#
# The GPU targets (bench-kda, bench-moe, bench-train, bench-scale, bench-sweep, test-gpu) run on a CUDA machine with the
# system `python3` (jax, flax, optax, orbax, chex, torch and triton installed; no .venv). Each
# writes JSON lines and logs to $(OUT) if set, else runs/bench/; docs/benchmarks.md holds the figures.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

BENCH_OUT := $(or $(OUT),runs/bench)
GPU_ENV := PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
# Date, GPUs and commit of every GPU run, beside its results (a tree exported without .git can
# name its commit in a COMMIT file).
RECORD_ENV = mkdir -p $(BENCH_OUT) && { date -u; nvidia-smi \
  --query-gpu=name,memory.total,driver_version --format=csv; \
  cat COMMIT 2>/dev/null || git describe --always --dirty --abbrev=40; } > $(BENCH_OUT)/env.txt 2>&1

.PHONY: venv train test bench-kda bench-moe bench-train bench-scale bench-sweep test-gpu clean

venv: $(STAMP)

# uv installs in parallel and compiles no bytecode up front: ~10 s where pip takes ~65 s. It is
# installed into the environment itself by pip, so nothing outside the repository is needed.
# Bytecode is then written at first import, for the modules actually used: the targets below
# allow it even where the caller's environment sets PYTHONDONTWRITEBYTECODE, or every process
# of the suite would compile jax's sources again (~8 s each).
$(STAMP): pyproject.toml
	@set -e; py=$$(scripts/find_python312.sh); \
	  [ -x $(PY) ] || "$$py" -m venv $(VENV); \
	  $(PY) -m pip install -q uv; \
	  $(VENV)/bin/uv pip install -q --python $(PY) -e '.[dev]'; \
	  touch $(STAMP)

# Trains the default config (k3_tiny) on the built-in corpus on the CPU.
train: $(STAMP)
	PYTHONDONTWRITEBYTECODE= JAX_PLATFORMS=cpu $(PY) train.py --config configs/k3_tiny.py --workdir runs/tiny $(ARGS)

# The whole suite; GPU-only tests skip themselves on a machine without one.
test: $(STAMP)
	$(PY) -m ruff check .
	PYTHONDONTWRITEBYTECODE= JAX_PLATFORMS=cpu $(PY) -m pytest -q -n 2 --dist loadfile $(ARGS)

# One Hopper GPU: the KDA op, forward and forward+backward, ours and jax-linear-attention at the
# four benchmark shapes in one process, then fla at (1, 8192, 16, 128) (its Triton autotuning takes
# minutes a shape). Peers come from wheels in .whl/ (scripts/install_peers.sh); ARGS="--shapes
# B,T,H,D ..." picks other shapes.
bench-kda:
	@$(RECORD_ENV)
	set -o pipefail; peers=$$(scripts/install_peers.sh $(BENCH_OUT)/pip.log); \
	  export $(GPU_ENV) CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$$peers:$(CURDIR); \
	  python3 benchmarks/kda.py --impls ours_pallas,jla --out $(BENCH_OUT)/kda.jsonl \
	    $(ARGS) 2>&1 | tee $(BENCH_OUT)/kda.log; \
	  python3 benchmarks/kda.py --impls fla --shapes 1,8192,16,128 --out $(BENCH_OUT)/kda.jsonl \
	    2>&1 | tee $(BENCH_OUT)/kda_fla.log

# Two Hopper GPUs: the 4-block MoE step on one GPU and on two (dropless ring dispatch and a
# capacity factor of 1.125, Mosaic grouped matmuls, layers unrolled), then the routed part alone
# per dispatch.
bench-moe:
	@$(RECORD_ENV)
	set -o pipefail; export $(GPU_ENV) PYTHONPATH=$(CURDIR); \
	  python3 benchmarks/moe.py --skip grouped_matmul,dispatch --dispatches ring,ring@1.125 \
	    --step-gmm mosaic --stacks unrolled --iters 5 --repeats 3 --out $(BENCH_OUT)/moe.jsonl \
	    2>&1 | tee $(BENCH_OUT)/moe_step.log; \
	  python3 benchmarks/moe.py --skip grouped_matmul,step --dispatches ring,all_to_all \
	    --gmm mosaic --iters 5 --repeats 3 --out $(BENCH_OUT)/moe.jsonl \
	    2>&1 | tee $(BENCH_OUT)/moe_dispatch.log

# One GPU: k3_small's train step profiled (compile stages, tokens/s, MFU, device time by category
# and model source; ops.jsonl and the HLO in $(BENCH_OUT)/profile), then 30 training steps of
# k3_small (tokens/s, MFU, first-step time in the run's metrics.jsonl). CORPUS=DIR trains on a
# corpus built by `python -m k3jax.data build`.
bench-train:
	@$(RECORD_ENV)
	set -o pipefail; export $(GPU_ENV) CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$(CURDIR); \
	  rm -rf $(BENCH_OUT)/k3_small; \
	  mkdir -p $(BENCH_OUT)/profile; python3 benchmarks/step_profile.py --config k3_small \
	    --out $(BENCH_OUT)/profile 2>&1 | tee $(BENCH_OUT)/step_profile.log \
	    | grep '^{' > $(BENCH_OUT)/step_profile.jsonl; \
	  python3 train.py --config configs/k3_small.py --workdir $(BENCH_OUT)/k3_small \
	    $(if $(CORPUS),--set data.data_dir=$(CORPUS)) --set train.steps=30 --set eval.batches=2 \
	    --set eval.tasks= --set eval.every=1000 --set checkpoint.every=1000 \
	    2>&1 | tee $(BENCH_OUT)/k3_small.log

# The GPUs of one host (8; LAYOUTS picks others): k3_1b's step in weak scaling, 16 x 2048 tokens
# per device in one micro-batch, on 1 to 8 devices in data-parallel, expert-parallel and
# fsdp x expert layouts (tokens/s per device against 1 and 2 devices, per-device memory, the
# collectives' and the MoE dispatch's share of the step; each point's profile under
# $(BENCH_OUT)/scale).
LAYOUTS ?= data=1 data=2 expert=2 data=4 fsdp=2,expert=2 data=8 fsdp=4,expert=2 fsdp=2,expert=4
bench-scale:
	@$(RECORD_ENV)
	set -o pipefail; export $(GPU_ENV) PYTHONPATH=$(CURDIR); \
	  python3 benchmarks/scale_out.py --config k3_1b --per-device-batch 16 \
	    --set train.micro_batches=1 --layouts $(LAYOUTS) --out $(BENCH_OUT)/scale \
	    2>&1 | tee $(BENCH_OUT)/scale_out.log | grep '^{' > $(BENCH_OUT)/scale_out.jsonl

# The GPUs of one host: the 16 short runs of configs/sweeps/fill_gpus.py two to a GPU on every GPU,
# then the same runs in turn on the first GPU; each sweep's wall time in sweep_times.txt, and its
# report (whose summary opens with the time points were running against their own times added).
bench-sweep:
	@$(RECORD_ENV)
	set -o pipefail; export $(GPU_ENV) PYTHONPATH=$(CURDIR); spec=configs/sweeps/fill_gpus.py; \
	  rm -rf $(BENCH_OUT)/sweep_side_by_side $(BENCH_OUT)/sweep_in_turn; \
	  t0=$$(date +%s); python3 -m k3jax.sweep run $$spec --dir $(BENCH_OUT)/sweep_side_by_side \
	    2>&1 | tee $(BENCH_OUT)/sweep_side_by_side.log; \
	  echo "side by side, every GPU: $$(( $$(date +%s) - t0 )) s" | tee $(BENCH_OUT)/sweep_times.txt; \
	  t0=$$(date +%s); CUDA_VISIBLE_DEVICES=0 python3 -m k3jax.sweep run $$spec --per-device 1 \
	    --dir $(BENCH_OUT)/sweep_in_turn 2>&1 | tee $(BENCH_OUT)/sweep_in_turn.log; \
	  echo "in turn, one GPU: $$(( $$(date +%s) - t0 )) s" | tee -a $(BENCH_OUT)/sweep_times.txt; \
	  for d in side_by_side in_turn; do python3 -m k3jax.sweep report $(BENCH_OUT)/sweep_$$d; done

# Every GPU test file at real sizes (the two-GPU dispatch tests skip themselves on one GPU).
test-gpu:
	@$(RECORD_ENV)
	set -o pipefail; $(GPU_ENV) PYTHONPATH=$(CURDIR) JAX_PLATFORMS=cuda python3 -m pytest -q -rA tests/test_pallas_kda_gpu.py \
	  tests/test_grouped_matmul_gpu.py tests/test_ep_dispatch_gpu.py tests/test_attention.py \
	  tests/test_short_conv.py tests/test_depth_mix_norm.py tests/test_glu_pair.py \
	  tests/test_gated_head_norm.py 2>&1 | tee $(BENCH_OUT)/test_gpu.log

clean:
	rm -rf $(VENV) runs .pytest_cache

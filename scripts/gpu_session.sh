#!/usr/bin/env bash
# What one lent GPU session runs, in the order that matters, each part time-boxed, logs under $OUT.
#
#   bash scripts/gpu_session.sh kda              # any kind, GPU 0: scores kernels' tests, parts, peers
#   bash scripts/gpu_session.sh kda_full         # any kind, GPU 0: all KDA GPU tests, parts, profile
#   bash scripts/gpu_session.sh kda_peers        # any kind, GPU 0: all four shapes, ours vs jla, fla
#   bash scripts/gpu_session.sh kda_dev          # any kind, GPU 0: all KDA GPU tests, ours at 4 shapes
#   bash scripts/gpu_session.sh kda_final        # any kind, GPU 0: all KDA GPU tests, ours vs jla
#   bash scripts/gpu_session.sh kda_side         # any kind, GPU 0: ours, jla and fla in one process
#   bash scripts/gpu_session.sh two              # two H200s: MoE GPU tests, 1-vs-2-GPU step, dispatches
#   bash scripts/gpu_session.sh one CORPUS_DIR   # one H200: step breakdown, k3_small training
#
# CORPUS_DIR: a corpus built by `python -m k3jax.data build ... --tokenizer bpe --vocab 16384` (the
# machines have no network: carry it). Peers' wheels for the KDA benchmark (fla-core,
# flash-linear-attention, jax-linear-attention) are installed from $WHEELS (default ./.whl).
# Each mode is one device call: its boxes add up to under 10 minutes, the device tool's limit.
# Everything lands in one archive, $OUT/logs.tgz.
# To run a commit rather than the working tree, run it in a snapshot that names its commit:
#   git archive HEAD | tar -x -C SNAP && git rev-parse HEAD > SNAP/COMMIT
set -u
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  cat COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null; } > "$OUT/env.txt" 2>&1
part() { local name=$1 secs=$2; shift 2; timeout "$secs" "$@" > "$OUT/$name.log" 2>&1;
         echo "[$name] rc=$? $(tail -1 "$OUT/$name.log" | cut -c1-200)"; }

peers() {  # the KDA benchmark's peers, from wheels carried in $WHEELS (default ./.whl)
  local wheels=${WHEELS:-.whl}
  if [ -d "$wheels" ]; then
    python3 -m pip install --no-index --no-deps --target /tmp/site "$wheels"/*.whl > "$OUT/pip.log" 2>&1
    export PYTHONPATH=/tmp/site:$PYTHONPATH
  else
    echo "no wheels folder $wheels: the peers will be missing" > "$OUT/pip.log"
  fi
}
ours_profile() {  # what benchmarks/kda.py --profile /tmp/prof left of ours: top kernels, its HLO
  python3 benchmarks/profile_top.py /tmp/prof/ours_pallas --top 40 > "$OUT/profile_top.jsonl" 2>&1
  cp /tmp/prof/ours_pallas/hlo.txt.gz "$OUT/ours_pallas_hlo.txt.gz" 2>/dev/null
}
kda_gpu_tests() {  # every case of the KDA GPU test module
  part kda_gpu_tests 200 env CUDA_VISIBLE_DEVICES=0 JAX_PLATFORMS=cuda \
    python3 -m pytest -q -rA -s tests/test_pallas_kda_gpu.py
}
kda() {  # one GPU: the default path's GPU tests, ours and jla at one shape with a profile, parts
  part kda_tests 150 env CUDA_VISIBLE_DEVICES=0 JAX_PLATFORMS=cuda \
    python3 -m pytest -q -rA -s tests/test_pallas_kda_gpu.py -k values_and_gradients
  part kda_ours 100 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/kda.py \
    --impls ours_pallas,jla --shapes 8,4096,16,128 --profile /tmp/prof --out "$OUT/kda.jsonl"
  ours_profile
  # ptxas's register and spill counts of every Mosaic kernel the scores benchmark compiles.
  part kda_scores_parts 100 env CUDA_VISIBLE_DEVICES=0 MOSAIC_GPU_DUMP_PTXAS=1 python3 \
    benchmarks/kda_scores.py --variants kernels,exact_exp,exact_levels --out "$OUT/kda_scores.jsonl"
  grep -E "Compiling entry|Used [0-9]+ registers|spill" "$OUT/kda_scores_parts.log" > "$OUT/ptxas.txt"
  grep '^{' "$OUT/kda_scores_parts.log" > "$OUT/kda_scores_parts.jsonl"; rm "$OUT/kda_scores_parts.log"
}
kda_full() {  # one GPU: every KDA GPU test, the scores kernels alone, a profile of ours
  kda_gpu_tests
  part kda_scores_parts 70 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/kda_scores.py \
    --variants kernels,exact_exp,exact_levels --out "$OUT/kda_scores.jsonl"
  part kda_profile 80 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/kda.py \
    --impls ours_pallas --shapes 8,4096,16,128 --profile /tmp/prof --out "$OUT/kda_profile.jsonl"
  ours_profile
}
kda_peers() {  # one GPU: all four shapes, ours and jla in one process, then fla in its own box
  part kda_bench 250 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/kda.py \
    --impls ours_pallas,jla --out "$OUT/kda.jsonl"
  # fla's Triton autotuning takes minutes on its first shape (110 and 170 s boxes were too short).
  part kda_fla 240 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/kda.py --impls fla \
    --shapes 1,8192,16,128 --out "$OUT/kda.jsonl"
}
kda_dev() {  # one GPU: every KDA GPU test, ours at all four shapes (profile: the first), registers
  kda_gpu_tests
  part kda_ours 200 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/kda.py --impls ours_pallas \
    --shapes ${SHAPES:-8,4096,16,128 1,8192,16,128 2,8192,64,128 1,32768,16,128} --profile /tmp/prof \
    --out "$OUT/kda.jsonl"
  ours_profile
  part kda_scores_parts 80 env CUDA_VISIBLE_DEVICES=0 MOSAIC_GPU_DUMP_PTXAS=1 python3 \
    benchmarks/kda_scores.py --variants kernels --out "$OUT/kda_scores.jsonl"
  grep -E "Compiling entry|Used [0-9]+ registers|spill" "$OUT/kda_scores_parts.log" > "$OUT/ptxas.txt"
  grep '^{' "$OUT/kda_scores_parts.log" > "$OUT/kda_scores_parts.jsonl"; rm "$OUT/kda_scores_parts.log"
}
kda_final() {  # one GPU: every KDA GPU test, then ours and jla at all four shapes (profile: the first)
  kda_gpu_tests
  part kda_bench 290 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/kda.py --impls ours_pallas,jla \
    --profile /tmp/prof --out "$OUT/kda.jsonl"
  ours_profile
  python3 benchmarks/profile_top.py /tmp/prof/jla --top 20 > "$OUT/profile_jla.jsonl" 2>&1
}
kda_side() {  # one GPU: ours, jla and fla side by side in one process at one shape (SHAPE)
  # fla's Triton autotuning takes minutes on its first shape: one shape fits a device call.
  part kda_side 400 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/kda.py --impls ours_pallas,jla,fla \
    --shapes "${SHAPE:-1,8192,16,128}" --out "$OUT/kda.jsonl"
}
moe() {  # two GPUs: grouped-matmul and dispatch GPU tests, then the target (ring step, 1 vs 2 GPUs)
  part gmm_gpu_tests 170 env JAX_PLATFORMS=cuda python3 -m pytest -q -rA \
    tests/test_grouped_matmul_gpu.py tests/test_ep_dispatch_gpu.py
  part moe_step 190 python3 benchmarks/moe.py --skip grouped_matmul,dispatch \
    --dispatches "${DISPATCHES:-ring,ring@1.125}" \
    --step-gmm mosaic --stacks "${STACKS:-unrolled}" --iters 5 --repeats 3 \
    --profile /tmp/prof --out "$OUT/moe.jsonl"
  for d in /tmp/prof/*/; do
    echo "{\"profile\": \"$(basename "$d")\"}"; python3 benchmarks/profile_top.py "$d" --top 40
  done > "$OUT/moe_profile.jsonl" 2>&1
  # ragged_all_to_all is left out by default: ~0.2-0.4 s a call on one host (docs/benchmarks.md),
  # its timing alone fills this box; DISPATCH_TIMES=ring,all_to_all,ragged_all_to_all adds it.
  part moe_dispatch 110 python3 benchmarks/moe.py --skip grouped_matmul,step \
    --dispatches "${DISPATCH_TIMES:-ring,all_to_all}" --gmm mosaic --iters 5 --repeats 3 \
    --out "$OUT/moe.jsonl"
}

case "${1:-}" in
one)
  corpus=${2:?usage: gpu_session.sh one CORPUS_DIR}
  export CUDA_VISIBLE_DEVICES=0
  part step_breakdown 140 python3 benchmarks/step_breakdown.py
  part k3_small 170 python3 train.py --config configs/k3_small.py --workdir /tmp/k3s \
    --set data.data_dir="$corpus" --set train.steps=30 --set eval.batches=2 --set eval.tasks= \
    --set eval.every=1000 --set checkpoint.every=1000
  cp /tmp/k3s/metrics.jsonl "$OUT/k3_small_metrics.jsonl" 2>/dev/null ;;
two)
  moe ;;
kda)  # any lent kind, GPU 0
  peers; kda ;;
kda_full)
  peers; kda_full ;;
kda_peers)
  peers; kda_peers ;;
kda_dev)
  kda_dev ;;
kda_final)
  peers; kda_final ;;
kda_side)
  peers; kda_side ;;
*)
  echo "usage: gpu_session.sh kda | kda_full | kda_peers | kda_dev | kda_final | kda_side | two | one CORPUS_DIR" >&2
  exit 2 ;;
esac
# One archive: the device tool brings back only a few files per call.
tar -czf /tmp/logs.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/logs.tgz "$OUT/logs.tgz"

#!/usr/bin/env bash
# Installs the KDA benchmark's optional peers (fla-core, flash-linear-attention,
# jax-linear-attention) from wheel files, for machines without network access, and prints the folder
# to put on PYTHONPATH. Wheels come from $WHEELS (default .whl/); --no-deps keeps the preinstalled
# jax, torch and triton. The folder is $PEERS_DIR, by default runs/peers/ in the repository (beside
# the benchmarks' output, ignored by git); --upgrade replaces what an earlier install left there.
# Without wheels it prints nothing and the benchmark skips the peers.
#   usage: scripts/install_peers.sh [LOG]
set -u
wheels=${WHEELS:-.whl}
target=${PEERS_DIR:-$(cd "$(dirname "$0")/.." && pwd)/runs/peers}
log=${1:-/dev/stderr}
if ! ls "$wheels"/*.whl > /dev/null 2>&1; then
  echo "no wheels in $wheels/: the KDA benchmark runs without fla and jax-linear-attention" >> "$log"
  exit 0
fi
python3 -m pip install --no-index --no-deps --upgrade --target "$target" "$wheels"/*.whl \
  >> "$log" 2>&1 && echo "$target"

#!/bin/bash
# Recipe comparison on an equal budget (docs/training.md): 3 runs x 600 steps from the same init
# and seed on the same data. Usage: benchmarks/compare_recipes.sh DATA_DIR [STEPS]
set -e
data=${1:?usage: benchmarks/compare_recipes.sh DATA_DIR [STEPS]}
steps=${2:-600}
for r in "ce bidirectional" "ce causal" "kl bidirectional"; do
  set -- $r
  out=${OUT_DIR:-runs}/cmp$steps-$1-$2
  python3 -m mlx_spec train drafter --data "$data" --out "$out" --resume --steps "$steps" \
    --seqs-per-step 4 --anchors 16 --draft-vocab 8192 --init-target-layers --lr 1e-3 --loss "$1" \
    --attention "$2" --checkpoint-every "$steps" --eval-prompts 6 --eval-max-tokens 64 > "$out.log" 2>&1
  grep "eval step" "$out.log" | tail -1
done

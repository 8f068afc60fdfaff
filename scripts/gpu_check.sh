#!/usr/bin/env bash
# A change's check on the lent GPU machine: the GPU tests, and the kernel bench and the Qwen3.6-27B-shape replay of
# this tree side by side with a reference tree in one call (VMs differ by ~1-2 % in AR speed, so only figures of one
# call compare). The reference is another commit's code, unpacked here into the ignored .oldk and carried:
#
#   git archive <commit> -- modeling_weaver kernels scripts hub_configs | (rm -rf .oldk; mkdir .oldk; tar x -C .oldk)
#   run                        bash scripts/gpu_check.sh suite [pytest args]     # a part (README: GPU tests)
#   run carry=[".oldk"]        bash scripts/gpu_check.sh kernels                 # ≈ 3 min
#   run carry=[".oldk"]        bash scripts/gpu_check.sh replay                  # ≈ 8 min
#
# Every job runs under `timeout` and writes into $OUT, so a call always brings back what finished.
set -u
OUT=${OUT:-/tmp/gpu_check}; REF=${REF:-.oldk}
mkdir -p "$OUT"
in_tree() {  # run "$2..." with the code of tree $1 (this repo: .) on the path
  local tree=$1; shift
  (cd "$tree" && PYTHONPATH=$PWD:$PWD/kernels "$@")
}
case ${1:?suite|kernels|replay} in
  suite) shift
    timeout ${SUITE_S:-540} python3 -m pytest -m gpu -q -p no:cacheprovider --junitxml="$OUT/gpu-suite.xml" "$@" \
      2>&1 | tail -40 ;;
  kernels)  # the default-form GDN verify + commit at the 27B layer shape (BENCHMARKS.md, Kernels)
    [ -d "$REF/kernels" ] || { echo "no reference tree in $REF" >&2; exit 2; }
    for tree in . "$REF"; do
      name=$([ "$tree" = . ] && echo this || echo ref)
      in_tree "$tree" timeout ${KERNELS_S:-150} python3 scripts/bench_kernels.py --T 64 65 128 129 \
        --kinds best_first deep15 --impls fused --no-fla --no-ref --no-baseline --layers 16 --reps 30 --verify-peel \
        --out "$OUT/kernels-$name.json" > "$OUT/kernels-$name.log" 2>&1
      echo "$name rc=$?"; tail -25 "$OUT/kernels-$name.log"
    done ;;
  replay)  # replayed acceptance at budget 64, compiled steps in CUDA graphs (BENCHMARKS.md, 27B-shape replay)
    [ -d "$REF/modeling_weaver" ] || { echo "no reference tree in $REF" >&2; exit 2; }
    for tree in . "$REF"; do
      name=$([ "$tree" = . ] && echo this || echo ref)
      in_tree "$tree" timeout ${REPLAY_S:-270} python3 -m modeling_weaver.cli replay \
        --synthetic-mal chain=4 ddtree=5.4 weaver=7.1 --budgets ${BUDGETS:-64} --target-step compiled --hf-tokens 0 \
        --out "$OUT/replay-$name" > "$OUT/replay-$name.log" 2>&1
      echo "$name rc=$?"; grep "^|" "$OUT/replay-$name.log" | head -12
    done ;;
  *) echo "unknown part $1" >&2; exit 2 ;;
esac

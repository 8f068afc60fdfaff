#!/usr/bin/env bash
# The recipe behind the shipped SmolLM2-135M-Instruct drafters (checkpoints/smollm2-135m-instruct), one stage per
# argument, each bounded in minutes so it fits the lent GPU machine's 10-minute calls (modeling_weaver/smollm2.py
# says how the GGUF gets there). Work goes to $WORK (default .smol_dev/work); `pack` tars what should come back into
# $OUT in ≤ 15 MiB pieces (join here with `cat pack.tgz.* | tar xzf -`).
#
#   scripts/train_smollm2.sh data dflash pack     # call 2 (after the GGUF is in place)
#   scripts/train_smollm2.sh weaver bench pack    # call 3, while the machine is still warm
set -euo pipefail
WORK=${WORK:-.smol_dev/work}
DATA_MIN=${DATA_MIN:-3.3} DFLASH_MIN=${DFLASH_MIN:-4.5} WEAVER_MIN=${WEAVER_MIN:-3} BENCH_MIN=${BENCH_MIN:-3.5}
mkdir -p "$WORK"
for stage in "$@"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case $stage in
    data)    # target-written prompts + the target's own answers (half greedy, half T=0.7), leak-checked
      python3 -m modeling_weaver.cli make-data --out "$WORK/data" --num-samples 1000000 --batch-size 512 \
        --max-response-tokens 512 --max-minutes "$DATA_MIN" --no-progress ;;
    dflash)  # 5-layer block drafter, block 16, learned mask embedding (SmolLM2 has no MASK token)
      python3 -m modeling_weaver.cli train-dflash --data "$WORK/data" --output-dir "$WORK/dflash" \
        --batch-size 8 --max-minutes "$DFLASH_MIN" --save-every 0 --no-progress ;;
    weaver)  # 1-layer Weaver, pool 512, DFlash frozen
      python3 -m modeling_weaver.cli train-weaver --data "$WORK/data" --drafter "$WORK/dflash" \
        --output-dir "$WORK/weaver" --batch-size 8 --max-minutes "$WEAVER_MIN" --save-every 0 --no-progress ;;
    bench)
      python3 -m modeling_weaver.cli bench --drafter "$WORK/dflash" --weaver "$WORK/weaver" --subset "${SUBSET:-10}" \
        --max-new-tokens "${NEW_TOKENS:-128}" --budgets 64 32 16 --temperatures 0 1 --sampling-verifications both \
        --max-minutes "$BENCH_MIN" --out "$WORK/bench" --no-progress ;;
    pack)
      (cd "$WORK" && find . -path ./data/shard-\* -prune -o -name training_state.pt -prune -o -type f -print \
        | tar czf - -T -) | split -b 15M - "${OUT:-.}/pack.tgz." ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done

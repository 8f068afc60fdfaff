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
DATA_MIN=${DATA_MIN:-2.2} DFLASH_MIN=${DFLASH_MIN:-4} WEAVER_MIN=${WEAVER_MIN:-1.2} BENCH_MIN=${BENCH_MIN:-3.5}
EXTRA_DATA=${EXTRA_DATA:-}  # a folder of earlier shard-*.pt to train on as well (copied in as shard-extra-*)
mkdir -p "$WORK"
for stage in "$@"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case $stage in
    data)    # target-written prompts + the target's own answers (half greedy, half T=0.7), leak-checked
      python3 -m modeling_weaver.cli make-data --out "$WORK/data" --num-samples 1000000 --batch-size 2048 \
        --max-response-tokens 384 --max-minutes "$DATA_MIN" --no-progress
      if [ -n "$EXTRA_DATA" ]; then
        for f in "$EXTRA_DATA"/shard-*.pt; do cp "$f" "$WORK/data/shard-extra-$(basename "$f" | tr -cd '0-9').pt"; done
      fi ;;
    dflash)  # 3-layer block drafter started from the target's last 3 layers, block 16, learned mask embedding
      # (SmolLM2 has no MASK token); epochs are many: --max-minutes ends the run and its cosine schedule
      python3 -m modeling_weaver.cli train-dflash --data "$WORK/data" --output-dir "$WORK/dflash" --num-layers 3 \
        --batch-size 8 --epochs 100 --max-minutes "$DFLASH_MIN" --save-every 0 --log-every 50 --no-progress ;;
    weaver)  # 1-layer Weaver, pool 512, DFlash frozen
      python3 -m modeling_weaver.cli train-weaver --data "$WORK/data" --drafter "$WORK/dflash" \
        --output-dir "$WORK/weaver" --batch-size 8 --epochs 100 --max-minutes "$WEAVER_MIN" --save-every 0 \
        --log-every 50 --no-progress ;;
    bench)
      python3 -m modeling_weaver.cli bench --drafter "$WORK/dflash" --weaver "$WORK/weaver" --subset "${SUBSET:-10}" \
        --max-new-tokens "${NEW_TOKENS:-128}" --budgets 64 32 16 --temperatures 0 1 --sampling-verifications both \
        --max-minutes "$BENCH_MIN" --out "$WORK/bench" --no-progress ;;
    pack)
      (cd "$WORK" && find . -name training_state.pt -prune -o -type f -print \
        | tar czf - -T -) | split -b 15M - "${OUT:-.}/pack.tgz." ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done

#!/usr/bin/env bash
# The recipe behind the SmolLM2-135M-Instruct drafters, one stage per argument, each bounded in minutes so that it
# fits the lent GPU machine's 10-minute calls (zoo/smollm2-135m-instruct/README.md says how the GGUF gets there;
# keep $WORK outside the repo, e.g. /tmp/smol/work: the repo copy is replaced on every call). Stages: gguf, data,
# dflash, weaver, profile, back; bound every background job of a call with `timeout` so that the call's last
# lines (`back`) always run inside the 10 minutes.
#
#   scripts/train_smollm2.sh gguf                  # after the three GGUF parts are in /tmp/smol
#   scripts/train_smollm2.sh data dflash back      # generate, train, bring weights and manifests back
#   scripts/train_smollm2.sh dflash back           # the same run resumed (--resume) while the machine is warm
#   scripts/train_smollm2.sh weaver profile back   # the Weaver on the new drafter, its acceptance, back
#
# Zoo v2 (zoo/smollm2-135m-instruct/README.md): `gguf` joins /tmp/smol/*.part* and converts; `data` with MIX=... draws user turns from
# several sources (TAG names the shards, SEED must differ per run, HELDOUT turns are excluded); DFLASH_FLAGS /
# WEAVER_FLAGS add trainer flags (e.g. --kd-weight 0.5 --ema 0.999 --schedule constant); `profile` measures
# teacher-forced acceptance on the eval prompts and on HELDOUT; `back` copies weights, logs, manifests and the data
# (xz) into $OUT.
#
# DFlash runs DFLASH_TOTAL minutes of schedule in chunks of at most DFLASH_MIN per call (--session-minutes), the
# Weaver WEAVER_TOTAL in chunks of WEAVER_MIN. A machine can go cold between calls: end every training call by
# bringing the weights back into $OUT (`back`, or a cp of the model folder).
# RUN launches data, dflash and weaver: `RUN="torchrun --standalone --nproc-per-node 8"` runs them on 8 GPUs (data: a
# TAG with {rank} names each rank's shards, seeds SEED + 1000·rank; training: DDP, the same checkpoints as one GPU).
set -euo pipefail
WORK=${WORK:-/tmp/smol/work} RUN=${RUN:-python3}
DATA_MIN=${DATA_MIN:-2.5} DFLASH_MIN=${DFLASH_MIN:-8} DFLASH_TOTAL=${DFLASH_TOTAL:-16} WEAVER_MIN=${WEAVER_MIN:-4}
WEAVER_TOTAL=${WEAVER_TOTAL:-$WEAVER_MIN} BENCH_MIN=${BENCH_MIN:-3.5}
DFLASH_DIR=${DFLASH_DIR:-$WORK/dflash}  # the drafter the weaver and bench stages read (e.g. the shipped one)
DFLASH_OUT=${DFLASH_OUT:-$WORK/dflash}  # where the dflash stage trains (DFLASH_FLAGS: extra train-dflash flags)
HELDOUT=${HELDOUT:-zoo/smollm2-135m-instruct/heldout_prompts.jsonl}  # never trained on; profiled

# --resume when DIR holds a run, else --init-from INIT when given (a folder of weights: fresh optimizer and schedule)
start_flags() { if [ -f "$2/training_state.pt" ]; then echo --resume; elif [ -n "$1" ]; then echo --init-from "$1"; fi; }
EXTRA_DATA=${EXTRA_DATA:-}  # a folder of earlier shard-*.pt to train on as well (copied in as shard-extra-*)
mkdir -p "$WORK"
for stage in "$@"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case $stage in
    gguf)    # the three GGUF parts carried into /tmp/smol by earlier calls; .whl carries gguf
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/gguf*.whl
      python3 -m modeling_weaver.cli fetch-smollm2 --gguf /tmp/smol/*.part0 /tmp/smol/*.part1 /tmp/smol/*.part2 ;;
    data)    # user turns (the target's own, or MIX) + the target's answers (half greedy, half T=0.7), leak-checked
      $RUN -m modeling_weaver.cli make-data --out "$WORK/data" --num-samples 1000000 --batch-size 2048 \
        --max-response-tokens 384 --max-minutes "$DATA_MIN" --sampler "${SAMPLER:-auto}" --seed "${SEED:-0}" \
        --max-prompt-tokens "${PROMPT_TOKENS:-128}" ${MIX:+--mix "$MIX" --exclude-prompts "$HELDOUT"} \
        ${TAG:+--tag "$TAG"} ${CODE_PACKAGES:+--code-packages $CODE_PACKAGES} --no-progress
      if [ -n "$EXTRA_DATA" ]; then
        for f in "$EXTRA_DATA"/shard-*.pt; do cp "$f" "$WORK/data/shard-extra-$(basename "$f" | tr -cd '0-9').pt"; done
      fi ;;
    dflash)  # DFLASH_LAYERS-layer block drafter (default 3) started from the target's last layers, block 16, learned
      # mask embedding (SmolLM2 has no MASK token). 64 anchors × 32 sequences per step: the dense block-sparse attention costs
      # (context + all blocks of the sequence) keys per query, so fewer blocks per sequence make each block cheaper.
      # DFLASH_INIT: a drafter folder to start from instead (a first run's weights, fresh optimizer and schedule;
      # grown to DFLASH_LAYERS when it has fewer).
      $RUN -m modeling_weaver.cli train-dflash --data "$WORK/data" --output-dir "$DFLASH_OUT" \
        --num-layers "${DFLASH_LAYERS:-3}" \
        --anchors 64 --batch-size 32 --epochs 100 --max-minutes "$DFLASH_TOTAL" --session-minutes "$DFLASH_MIN" \
        --save-every 0 --log-every 50 --no-progress $(start_flags "${DFLASH_INIT:-}" "$DFLASH_OUT") \
        ${DFLASH_FLAGS:-} ;;
    weaver)  # 1-layer Weaver, pool 512, DFLASH_DIR frozen; WEAVER_INIT: a Weaver folder to start from
      $RUN -m modeling_weaver.cli train-weaver --data "$WORK/data" --drafter "$DFLASH_DIR" \
        --output-dir "$WORK/weaver" --batch-size 8 --epochs 100 --max-minutes "$WEAVER_TOTAL" \
        --session-minutes "$WEAVER_MIN" --save-every 0 --log-every 50 --no-progress \
        $(start_flags "${WEAVER_INIT:-}" "$WORK/weaver") ${WEAVER_FLAGS:-} ;;
    profile) # teacher-forced acceptance of DFLASH_DIR (+ WORK/weaver if trained): eval prompts and held-out turns
      w=; [ -f "$WORK/weaver/config.json" ] && w="--weaver $WORK/weaver"
      python3 scripts/acceptance_profile.py --drafter "$DFLASH_DIR" $w --subset 8 --max-new-tokens 128 \
        --out "$WORK/profile-eval-${PROFILE_NAME:-x}" --overwrite > /dev/null
      python3 scripts/acceptance_profile.py --drafter "$DFLASH_DIR" $w --prompts "$HELDOUT" \
        --subset "${HELDOUT_N:-64}" --max-new-tokens 128 --out "$WORK/profile-heldout-${PROFILE_NAME:-x}" --overwrite \
        > /dev/null
      python3 scripts/zoo_curve.py summary "$WORK"/profile-*-"${PROFILE_NAME:-x}" ;;
    back)    # what the next call or session needs, into $OUT in ≤ 15 MiB pieces (join: cat X.tar.xz.* | tar xJf -):
      # every trained model folder but its training_state.pt, logs, profiles, data manifests; BACK_DATA=TAG: that
      # run's shards and prompts too
      (cd "$WORK" && find . -maxdepth 3 \( -name model.safetensors -o -name config.json -o -name train_log.jsonl \
        -o -name README.md -o -name "*.log" -o -path "./profile-*/*" -o -name "manifest-*.json" \) -print \
        | tar cf - -T -) | xz -T0 -3 | split -b 15M - "${OUT:-.}/models.tar.xz."
      [ -z "${BACK_DATA:-}" ] || (cd "$WORK" && tar cf - data/prompts-"${BACK_DATA}".jsonl \
        data/shard-"${BACK_DATA}"-*.pt) | xz -T0 -6 | split -b 15M - "${OUT:-.}/data-${BACK_DATA}.tar.xz." ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done

#!/usr/bin/env bash
# One Zoo v2 session on the lent GPU machine, call by call (README.md here: carrying the GGUF; runs.md: what each
# call did). Every job runs under `timeout` so that each call's packing into $OUT always runs; the calls must follow
# each other within the machine's 30 s idle release.
#
#   run carry=[".smol/a"]                  bash zoo/smollm2-135m-instruct/calls.sh carry a
#   run carry=[".smol/b"]                  bash zoo/smollm2-135m-instruct/calls.sh carry b
#   run carry=[".zoo/v4a"]                bash zoo/smollm2-135m-instruct/calls.sh init .zoo/v4a  # optional, see INIT
#   run carry=[".zoo/v4b"]                bash zoo/smollm2-135m-instruct/calls.sh init .zoo/v4b
#   run carry=[".smol/c", ".whl/gguf-0.19.0-py3-none-any.whl"]  calls.sh data  # GGUF, data, DFlash starts (the test
#                                          # wheels in .whl/test would take the call past 64 MiB)
#   run                                    bash zoo/smollm2-135m-instruct/calls.sh dflash    # DFlash resumed, Weaver, back
#   run carry=[".whl"]                     bash zoo/smollm2-135m-instruct/calls.sh bench     # profile, bench, GPU tests
#
# On a machine of N GPUs (nvidia-h200-x8, #32): `data` with RANKS=N generates on every GPU (one torchrun, shards
# TAG_BASE0..N-1), `scale` times the DFlash recipe on one GPU and on N side by side, and RUN="torchrun --standalone
# --nproc-per-node N" makes `dflash` (and the data call's DFlash) DDP on all of them.
#
# The weights come back at the end of the dflash call: if the machine goes cold before the bench call, put them into
# the working tree's checkpoints/smollm2-135m-instruct and bench there after carrying the GGUF again (a, b, c).
# Each session continues from the shipped pair (checkpoints/smollm2-135m-instruct) on fresh data: TAG_BASE names the
# session's shards and SEED_BASE their seeds (two generators: SEED_BASE+1, +2); both must be new (data_manifest.jsonl).
# INIT=/tmp/smol/init starts from an unshipped pair instead, carried by `init` calls (a pair is larger than one call
# carries beside the working tree: split model.safetensors into .part0/.part1, which `init` joins once both came).
set -u
export PYTHONPATH=/tmp/site:$PWD:$PWD/kernels MODELING_WEAVER_CACHE=/tmp/smol/cache
S=checkpoints/smollm2-135m-instruct W=/tmp/smol/work INIT=${INIT:-checkpoints/smollm2-135m-instruct}
E=$W/eval L=$W/logs OUT=${OUT:-/tmp/smol/out}
MIX=${MIX:-self=0.3,template=0.25,math=0.1,code=0.25,passage=0.1}
# WSD: constant lr, then a linear cooldown over the last 30 % of the session's DFlash minutes (runs.md: what the
# cooldown added). DFLASH_LAYERS above the shipped drafter's depth grows it (train-dflash --num-layers).
DFLASH_FLAGS=${DFLASH_FLAGS:-"--schedule wsd --decay 0.3 --lr 3e-4 --ema 0.999"}
DFLASH_TOTAL=${DFLASH_TOTAL:-10}  # minutes of schedule across the data and dflash calls (the dflash call: their sum)
mkdir -p $E $L $OUT /tmp/smol/cache
train() {  # DFlash from the shipped drafter (or resumed), for $1 minutes of this call
  WORK=$W DFLASH_INIT=$INIT/dflash DFLASH_TOTAL=$DFLASH_TOTAL DFLASH_MIN=$1 DFLASH_FLAGS="$DFLASH_FLAGS" \
    timeout $(( ${1%.*} * 60 + 90 )) bash scripts/train_smollm2.sh dflash >> $L/dflash.log 2>&1
  echo "dflash rc=$?"; tail -2 $L/dflash.log
}
case ${1:?carry|init|data|scale|dflash|bench} in
  carry)   mkdir -p /tmp/smol && cp .smol/$2/* /tmp/smol/ && ls -la /tmp/smol ;;
  init)    mkdir -p /tmp/smol/init && cp -r ${2:?}/. /tmp/smol/init/ && cd /tmp/smol/init &&
    for d in dflash weaver; do
      if [ -f $d/model.safetensors.part0 ] && [ -f $d/model.safetensors.part1 ]; then
        cat $d/model.safetensors.part0 $d/model.safetensors.part1 > $d/model.safetensors && rm $d/model.safetensors.part*
      fi
    done; ls -la /tmp/smol/init/* ;;
  data)    # ≈ 9 min: GGUF (30 s), two batch-2048 generators (four do not fit in the GPU's memory), DFlash for the rest
    cp .smol/c/*.part2 /tmp/smol/ && cp -r .smol/c/eval /tmp/smol/cache/
    WORK=$W timeout 120 bash scripts/train_smollm2.sh gguf > $L/gguf.log 2>&1 || { tail -20 $L/gguf.log; exit 1; }
    nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader; date -u
    if [ -n "${RANKS:-}" ]; then  # one generator per GPU (seeds SEED_BASE+1 + 1000·rank)
      WORK=$W MIX=$MIX TAG="${TAG_BASE:?}{rank}" SEED=$(( ${SEED_BASE:?} + 1 )) DATA_MIN=${DATA_MIN:-4.5} \
        RUN="torchrun --standalone --nproc-per-node $RANKS" CODE_PACKAGES="numpy sympy networkx" \
        timeout 360 bash scripts/train_smollm2.sh data > $L/data.log 2>&1; grep "^rank" $L/data.log
    else
      for i in 1 2; do
        WORK=$W MIX=$MIX TAG=${TAG_BASE:?}$i SEED=$(( ${SEED_BASE:?} + i )) DATA_MIN=${DATA_MIN:-4.5} \
          CODE_PACKAGES="numpy sympy networkx" timeout 360 bash scripts/train_smollm2.sh data > $L/data-$i.log 2>&1 &
      done
      wait; for i in 1 2; do tail -1 $L/data-$i.log; done
    fi
    train ${DATA_CALL_DFLASH_MIN:-2.5}
    (cd $W && tar cf - data/manifest-*.json logs) | xz -T0 -6 > $OUT/data-call.tar.xz; ls -la $OUT ;;
  dflash)  # ≈ 9 min: the DFlash resumed to the end of its schedule (DFLASH_TOTAL: both calls' minutes), then the
    # Weaver from the shipped one on it (the DFlash frozen); weights back
    DFLASH_TOTAL=$(awk "BEGIN { print ${DATA_CALL_DFLASH_MIN:-2.5} + ${DFLASH_CALL_MIN:-5.5} }") \
      train ${DFLASH_CALL_MIN:-5.5}
    WORK=$W DFLASH_DIR=$W/dflash WEAVER_INIT=$INIT/weaver WEAVER_MIN=${WEAVER_MIN:-1.5} WEAVER_TOTAL=${WEAVER_MIN:-1.5} \
      timeout 170 bash scripts/train_smollm2.sh weaver > $L/weaver.log 2>&1; echo "weaver rc=$?"; tail -1 $L/weaver.log
    WORK=$W bash scripts/train_smollm2.sh back
    (cd $W && tar cf - logs) | xz -T0 -6 > $OUT/dflash-call.tar.xz; ls -la $OUT ;;
  scale)   # ≈ 3 min after `data`: the DFlash recipe from INIT for SCALE_STEPS steps on one GPU, then on every GPU
    # (DDP, the same batch per GPU); tokens/s of each past the warm-up, side by side (fresh folders, nothing kept)
    n=$(nvidia-smi -L | wc -l) steps=${SCALE_STEPS:-300}
    flags="--data $W/data --init-from $INIT/dflash --num-layers ${DFLASH_LAYERS:-5} --anchors 64 --batch-size 32 \
      --max-steps $steps --save-every 0 --log-every 25 --no-progress $DFLASH_FLAGS"
    rm -rf $W/scale-1 $W/scale-$n
    timeout 150 python3 -m modeling_weaver.cli train-dflash $flags --output-dir $W/scale-1 > $L/scale-1.log 2>&1
    timeout 150 torchrun --standalone --nproc-per-node $n -m modeling_weaver.cli train-dflash $flags \
      --output-dir $W/scale-$n > $L/scale-$n.log 2>&1
    tail -1 $L/scale-1.log $L/scale-$n.log; python3 scripts/zoo_curve.py rate $W/scale-1 $W/scale-$n --skip 50
    (cd $W && tar cf - logs scale-*/train_log.jsonl) | xz -T0 -6 > $OUT/scale-call.tar.xz; ls -la $OUT ;;
  bench)  # ≈ 7 min: the profile beside the greedy bench (budgets 64 and 16) and, with .whl/test carried (pytest
    # wheels), the GPU tests of the loop, the adaptive budget and the KDA kernels: the bench's MAL does not depend
    # on the GPU being quiet
    ( WORK=$W DFLASH_DIR=$W/dflash PROFILE_NAME=${POINT:?} HELDOUT_N=32 timeout 280 bash scripts/train_smollm2.sh profile
    ) > $L/profile.log 2>&1 &
    if [ -d .whl/test ] && [ -z "${NO_TESTS:-}" ]; then  # (NO_TESTS=1: the bench and profile alone)
      python3 -m pip install -q --no-index --no-deps --target /tmp/site-test .whl/test/*.whl
      PYTHONPATH=/tmp/site-test:$PYTHONPATH:$PWD/tests timeout ${TESTS_S:-420} python3 -m pytest -v -m gpu \
        -p no:cacheprovider tests/test_gpu_loop.py tests/test_sampler.py tests/test_kda_tree.py \
        -k "not (compiled or int8 or spine or smollm2_size)" > $L/gpu-tests.log 2>&1 &
    fi
    timeout 330 python3 -m modeling_weaver.cli bench --drafter $W/dflash --weaver $W/weaver --subset 8 \
      --max-new-tokens 128 --budgets 64 16 --temperatures 0 --dtype float32 --target-step eager --no-plot --strict \
      --max-minutes 5 --no-progress --out $E/bench-$POINT > $L/bench.log 2>&1
    wait; tail -2 $L/profile.log; grep "^| 0 " $L/bench.log; tail -3 $L/gpu-tests.log 2>/dev/null; ls $E
    (cd $W && tar cf - eval logs profile-*) | xz -T0 -6 > $OUT/bench-call.tar.xz; ls -la $OUT ;;
  *) echo "unknown call $1" >&2; exit 2 ;;
esac

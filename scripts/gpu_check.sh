#!/usr/bin/env bash
# A change's check on the lent GPU machine: the GPU tests, and the kernel bench and the Qwen3.6-27B-shape replay of
# this tree side by side with a reference tree in one call (VMs differ by ~1-2 % in AR speed, so only figures of one
# call compare). The reference is another commit's code, unpacked here into the ignored .oldk and carried:
#
#   git archive <commit> -- modeling_weaver kernels scripts hub_configs | (rm -rf .oldk; mkdir .oldk; tar x -C .oldk)
#   run                        bash scripts/gpu_check.sh suite [pytest args]     # a part (README: GPU tests)
#   run                        bash scripts/gpu_check.sh suite_all               # every part, JOBS (4) at a time
#                              bash scripts/gpu_check.sh parts                   # the parts, as README.md lists them
#   run carry=[".oldk"]        bash scripts/gpu_check.sh kernels                 # ≈ 3 min
#   run carry=[".oldk"]        bash scripts/gpu_check.sh replay [replay args]    # > 8 min with every method
#   run                        bash scripts/gpu_check.sh auto [replay args]      # budget auto vs fixed (#29)
#   run carry=[".whl"]         bash scripts/gpu_check.sh kda [bench_kda args]    # KDA table (issue #31), ≤ 5 min
#   run carry=[".whl"]         bash scripts/gpu_check.sh kda_all                 # #31: table + GPU tests, ≤ 9 min
#   run                        bash scripts/gpu_check.sh replay35 [replay args]  # Qwen3.5-35B-A3B shape (#30), ≤ 9 min
#   run kind=nvidia-h200-x2 carry=[".whl"]  bash scripts/gpu_check.sh two_gpus  # device_map, tp_plan (#33), ≤ 8 min
#   run kind=nvidia-h200-x2    bash scripts/gpu_check.sh replay2 [replay args]   # 27B shape on 1 vs 2 GPUs (#33)
#
# Every job runs under `timeout` and writes into $OUT, so a call always brings back what finished.
set -u
OUT=${OUT:-/tmp/gpu_check}; REF=${REF:-.oldk}
mkdir -p "$OUT"
in_tree() {  # run "$2..." with the code of tree $1 (this repo: .) on the path
  local tree=$1; shift
  (cd "$tree" && PYTHONPATH=$PWD:$PWD/kernels "$@")
}
case ${1:?suite|suite_all|parts|kernels|replay|auto|kda|kda_all|replay35|two_gpus|replay2} in
  parts)  # the GPU suite's parts, one pytest command a line, from README.md's "GPU tests" (the one list of them)
    sed -n '/^### GPU tests/,/^## /p' README.md | grep '^pytest -q -m gpu ' | sed 's/ *# .*$//' ;;
  suite_all)  # every part at once, JOBS at a time on the one GPU: the tiny targets' tests are bound by launches and
    # compiles on the host (16 cores), not by the GPU; each part's log and JUnit XML land in $OUT
    mapfile -t parts < <(bash "$0" parts)
    start=$SECONDS
    for i in "${!parts[@]}"; do
      while [ "$(jobs -rp | wc -l)" -ge "${JOBS:-4}" ]; do wait -n; done
      ( t0=$SECONDS
        in_tree . timeout "${SUITE_S:-540}" bash -c "eval \"python3 -m \$1 -p no:cacheprovider --junitxml=\$2\"" _ \
          "${parts[$i]}" "$OUT/part-$i.xml" > "$OUT/part-$i.log" 2>&1
        echo "part $i rc=$? $((SECONDS - t0)) s: ${parts[$i]#pytest -q -m gpu } → $(tail -1 "$OUT/part-$i.log")" ) &
    done
    wait; echo "all parts: $((SECONDS - start)) s" ;;
  suite) shift
    in_tree . timeout ${SUITE_S:-540} python3 -m pytest -m gpu -q -p no:cacheprovider --junitxml="$OUT/gpu-suite.xml" "$@" \
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
  replay) shift  # replayed acceptance at budget 64, compiled steps in CUDA graphs (BENCHMARKS.md, 27B-shape replay);
    # extra args go to both replays (e.g. --modes weaver: one method, so that both trees fit one call)
    [ -d "$REF/modeling_weaver" ] || { echo "no reference tree in $REF" >&2; exit 2; }
    for tree in . "$REF"; do
      name=$([ "$tree" = . ] && echo this || echo ref)
      in_tree "$tree" timeout ${REPLAY_S:-270} python3 -m modeling_weaver.cli replay \
        --synthetic-mal chain=4 ddtree=5.4 weaver=7.1 --budgets ${BUDGETS:-64} --target-step compiled --hf-tokens 0 \
        --out "$OUT/replay-$name" "$@" > "$OUT/replay-$name.log" 2>&1
      echo "$name rc=$?"; grep "^|" "$OUT/replay-$name.log" | head -12
    done ;;
  auto) shift  # issue #29: auto against the fixed budgets at the 27B shape, this tree only (graph steps: one bucket
    # each); extra args go to the replay (e.g. --mixed 1.05 32: a mixed set) and NAME tells the run's folder apart
    name=replay-auto${NAME:+-$NAME}
    in_tree . timeout ${REPLAY_S:-540} python3 -m modeling_weaver.cli replay --synthetic-mal chain=4 ddtree=5.4 \
      weaver=7.1 --modes ${MODES:-ddtree weaver} --budgets ${BUDGETS:-16 32 64 auto} --target-step graph --hf-tokens 0 \
      --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
    echo "auto rc=$?"; grep "^|\|^Steps" "$OUT/$name.log" | tail -12 ;;
  kda) shift  # issue #31's KDA kernel table at Kimi Linear's shape: tree KDA vs tree GDN, baseline, fla (bench_kda.py)
    site=/tmp/site; whls=$(ls .whl/fla*.whl .whl/flash_linear*.whl .whl/einops*.whl 2>/dev/null)
    # the carried wheels (fla-core holds fla.ops; einops is its one dependency); without them the fla rows say why not
    [ -n "$whls" ] && { python3 -m pip install -q --no-index --no-deps --target "$site" $whls > "$OUT/kda-pip.log" 2>&1 \
      || echo "fla wheels not installed: $OUT/kda-pip.log"; }
    PYTHONPATH=$site:$PWD:$PWD/kernels timeout ${KDA_S:-300} python3 scripts/bench_kda.py --out "$OUT/kda" "$@" \
      > "$OUT/kda.log" 2>&1
    echo "kda rc=$?"; grep -q '^device:' "$OUT/kda.log" && sed -n '/^device:/,$p' "$OUT/kda.log" || tail -30 "$OUT/kda.log" ;;
  kda_all)  # issue #31's whole GPU check in one call: the table at T = 16/32/64/128 beside fla (KDA_S; each row is
    # logged as it is done), then the KDA kernels' GPU tests and Kimi Linear's greedy identity on the GPU side by side
    # (TEST_S; host-bound, so after the timings)
    KDA_S=${KDA_S:-360} bash "$0" kda --kinds best_first deep15 --no-neumann
    for t in "tests/test_kda_tree.py" "tests/test_gpu_loop.py -k kimi_linear"; do
      name=$(basename "${t%% *}" .py)
      ( in_tree . timeout ${TEST_S:-240} python3 -m pytest -m gpu -v -p no:cacheprovider $t \
          --junitxml="$OUT/$name.xml" > "$OUT/$name.log" 2>&1
        echo "$t rc=$?: $(grep -c PASSED "$OUT/$name.log") passed; $(tail -1 "$OUT/$name.log")"
        grep -E "FAILED|ERROR" "$OUT/$name.log" | head -5 ) &
    done
    wait ;;
  two_gpus)  # issue #33 on two GPUs: device_map split targets (the GPU tests) and tp_plan="auto" under torchrun (NCCL)
    in_tree . timeout ${SUITE_S:-240} python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_distributed_targets.py \
      --junitxml="$OUT/two-gpus.xml" 2>&1 | tail -15
    # tp_plan with the machine's transformers, then with a carried wheel (.whl/transformers-*.whl) if there is one
    sites=(""); whl=$(ls .whl/transformers-*.whl 2>/dev/null | head -1)
    [ -n "$whl" ] && python3 -m pip install -q --no-index --no-deps --target /tmp/tf-site "$whl" \
      > "$OUT/tf-pip.log" 2>&1 && sites+=("/tmp/tf-site")
    for site in "${sites[@]}"; do
      for family in qwen3 qwen3_5; do
        run="$OUT/tp-$family${site:+-carried}"; mkdir -p "$run"
        PYTHONPATH=$site:$PWD:$PWD/kernels:$PWD/tests timeout 120 python3 -c "import sys, tiny_targets as t; \
          getattr(t, 'tiny_' + sys.argv[1])().save_pretrained(sys.argv[2])" $family "$run/target" &&
        PYTHONPATH=$site:$PWD:$PWD/kernels timeout ${TP_S:-150} python3 -m torch.distributed.run --standalone \
          --nproc_per_node 2 tests/tp_worker.py "$run/target" "$run" > "$run.log" 2>&1
        echo "tp $family ${site:+(carried transformers)} rc=$?"
        if ls "$run"/rank-*.json > /dev/null 2>&1; then cut -c1-400 "$run"/rank-*.json; else tail -20 "$run.log"; fi
        rm -rf "$run/target"
      done
    done ;;
  replay2) shift  # issue #33: the Qwen3.6-27B shape on one GPU and spread over two by device_map, eager steps
    in_tree . timeout ${REPLAY_S:-540} python3 -m modeling_weaver.cli replay --devices 1 2 --target-step eager \
      --synthetic-mal chain=4 ddtree=5.4 weaver=7.1 --modes weaver --budgets 64 --max-new-tokens 128 \
      --hf-tokens 32 --out "$OUT/replay2" "$@" > "$OUT/replay2.log" 2>&1
    echo "replay2 rc=$?"; grep "^|" "$OUT/replay2.log" | tail -8; grep "^replayed" "$OUT/replay2.log" | cut -c1-600 ;;
  replay35) shift  # issue #30: the Qwen3.5-35B-A3B-shape replay (hybrid GDN + MoE), this tree only; as the 27B part
    # (bf16, compiled steps in CUDA graphs, budget 64); extra args go last (a fallback: --target-step graph, or
    # --experts-implementation batched_mm should grouped_mm not capture)
    in_tree . timeout ${REPLAY_S:-540} python3 -m modeling_weaver.cli replay --shape qwen3.5-35b-a3b \
      --synthetic-mal chain=4 ddtree=5.4 weaver=7.1 --budgets ${BUDGETS:-64} --target-step compiled --hf-tokens 0 \
      --out "$OUT/replay35" "$@" > "$OUT/replay35.log" 2>&1
    echo "replay35 rc=$?"; log="$OUT/replay35.log"
    grep -q "^| method" "$log" && sed -n '/^| method/,$p' "$log" | grep "^|\|^replayed" || tail -20 "$log" ;;
  *) echo "unknown part $1" >&2; exit 2 ;;
esac

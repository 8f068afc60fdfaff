#!/bin/bash
export PYTHONPATH=$PWD:$PWD/kernels PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
date -u +%H:%M:%S
timeout 120 python -m pytest -m gpu -q -x tests/test_kernels.py -k "weaver_tree_ops or gdn_decode_real" 2>&1 | tail -3 | tee $OUT/t_kernels.txt
date -u +%H:%M:%S
timeout 150 python -m pytest -m gpu -q -x tests/test_gpu_loop.py -k "spine" 2>&1 | tail -3 | tee $OUT/t_loop.txt
date -u +%H:%M:%S
timeout 240 python scripts/profile_ar_step.py --target-step compiled --tokens 8 --rows 25 --max-length 1100 --proposer weaver --no-tables --spine-ab 2 4 2>&1 | grep -v Warning | grep -v "^  warn" > $OUT/profile.txt; grep -E "GPU busy|_expand|_pool|##" $OUT/profile.txt | cut -c1-60,170-260
date -u +%H:%M:%S

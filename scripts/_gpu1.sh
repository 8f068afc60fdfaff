#!/bin/bash
# device call 1: GPU tests of the spine trees and node_attention, then the draft + tree graphs
export PYTHONPATH=$PWD:$PWD/kernels PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
pip install -q -e . --no-deps >/dev/null 2>&1
date -u +%H:%M:%S
timeout 150 python -m pytest -m gpu -q -x tests/test_kernels.py -k "weaver_tree_ops or node_attention" 2>&1 | tail -5 | tee $OUT/t_kernels.txt
date -u +%H:%M:%S
timeout 150 python -m pytest -m gpu -q -x tests/test_gpu_loop.py -k "spine" 2>&1 | tail -5 | tee $OUT/t_loop.txt
date -u +%H:%M:%S
timeout 330 python scripts/profile_ar_step.py --target-step compiled --tokens 8 --rows 45 --max-length 1100 --proposer chain --graphs --no-tables --spine-ab 1 2 4 2>&1 | grep -v Warning | tail -30 | tee $OUT/profile.txt
date -u +%H:%M:%S

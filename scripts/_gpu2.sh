#!/bin/bash
export PYTHONPATH=$PWD:$PWD/kernels PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
date -u +%H:%M:%S
timeout 200 python scripts/profile_ar_step.py --target-step compiled --tokens 8 --rows 60 --max-length 1100 --proposer weaver --no-tables 2>&1 | grep -v Warning | grep -v "^  warn" > $OUT/profile_weaver.txt; tail -5 $OUT/profile_weaver.txt
date -u +%H:%M:%S
timeout 380 python scripts/diagnose_fused_steps.py --out $OUT/diag --no-profile --modes weaver --mal 7.1 --ab spine 2>&1 | grep -v Warning | tail -12
date -u +%H:%M:%S

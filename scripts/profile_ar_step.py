"""Where one AR decode step of a random-weight hub-spec target spends its GPU time (torch.profiler, kernel table).

    python scripts/profile_ar_step.py --shape qwen3.6-27b --tokens 8
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from modeling_weaver.benchmark import autoregressive_generate
from modeling_weaver.replay import random_models


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="qwen3.6-27b")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=512)
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()
    target, _, _ = random_models(args.shape, torch.device("cuda"), torch.bfloat16)
    ids = torch.randint(0, 1000, (1, args.prompt_length), device="cuda")
    autoregressive_generate(target, ids, args.tokens, eos_token_id=[], target_step="static")  # warm-up
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        autoregressive_generate(target, ids, args.tokens, eos_token_id=[], target_step="static")
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))


if __name__ == "__main__":
    main()

"""GPU memory around the first merge of a target's shared-input projections (allocated and reserved, GiB).

    PYTHONPATH=$PWD:$PWD/kernels python scripts/check_merge_memory.py --layers 8

A random Qwen3.5-style hybrid at Qwen3.6-27B layer widths (``--layers`` of them, bf16): the merge must neither keep
a second copy of the weights (allocated) nor leave their old blocks reserved (the adapter empties the cache after a
merge that moved weights).
"""
import argparse

import torch


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from modeling_weaver.export import HUB_SPECS
    from modeling_weaver.target import TargetAdapter

    config = HUB_SPECS["qwen3.6-27b"].target()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    text.num_hidden_layers = args.layers
    text.layer_types = text.layer_types[: args.layers]
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(text, dtype=torch.bfloat16)
    gib = 2 ** 30
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated() / gib, torch.cuda.memory_reserved() / gib
    TargetAdapter(model, max_length=256)
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated() / gib, torch.cuda.memory_reserved() / gib
    print(f"{args.layers} layers: allocated {before[0]:.2f} → {after[0]:.2f} GiB, reserved {before[1]:.2f} → "
          f"{after[1]:.2f} GiB")


if __name__ == "__main__":
    main()

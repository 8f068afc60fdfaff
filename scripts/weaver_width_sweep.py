"""Mean accepted length of Weaver trees against the expansion width, on real SmolLM2 with the shipped drafters.

    python scripts/weaver_width_sweep.py --budget 64 --widths 1 4 8 16

Greedy, the first ``--subset`` MT-Bench and HumanEval prompts, ``--max-new-tokens`` each (CPU is fine). Fewer, wider
rounds are cheaper on a GPU; this shows what they cost in MAL. (On a replay at a larger target's depth also check
that the trees still reach the traced depths: a node of depth d needs d rounds.)
"""
import argparse
from pathlib import Path

import torch
from transformers import AutoModel

import modeling_weaver.tree as tree_module
from modeling_weaver import speculative_generate
from modeling_weaver.data import chat_prompt_ids, load_eval_prompts
from modeling_weaver.smollm2 import load_smollm2

SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "smollm2-135m-instruct"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--subset", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    model, tokenizer = load_smollm2()
    drafter = AutoModel.from_pretrained(SHIPPED / "dflash", trust_remote_code=True)
    weaver = AutoModel.from_pretrained(SHIPPED / "weaver", trust_remote_code=True)
    prompts = load_eval_prompts()
    ids = [torch.tensor([chat_prompt_ids(tokenizer, p.text)]) for name in ("mtbench", "humaneval")
           for p in prompts[name][: args.subset]]
    build = tree_module.weaver_tree_tensors
    try:
        for width in args.widths:
            tree_module.weaver_tree_tensors = lambda *a, w=width, **k: build(*a, **{**k, "width": w})
            lengths = []
            for x in ids:
                _, stats = speculative_generate(model, x, drafter=drafter, weaver=weaver, mode="weaver",
                                                tree_budget=args.budget, max_new_tokens=args.max_new_tokens,
                                                return_stats=True)
                lengths += stats.accepted_lengths
            print(f"budget {args.budget} width {width}: MAL {sum(lengths) / len(lengths):.3f} over {len(lengths)} "
                  f"steps", flush=True)
    finally:
        tree_module.weaver_tree_tensors = build


if __name__ == "__main__":
    main()

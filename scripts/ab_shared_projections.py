"""Side-by-side A/B of the merged shared-input projections (``SharedInputLinears``) on SmolLM2, in one process.

    python scripts/ab_shared_projections.py --pairs 3 --mode weaver --tree-budget 16 --max-new-tokens 64

The demo's target, shipped drafters and prompts (``weaver demo`` defaults); each pair runs our AR and the speculative
loop (eager steps) over every prompt with merging off and on (order alternating between pairs, so drift does not
favour one side), checks the outputs against AR and prints tokens/s per side. Merging moves the weights into shared
storage once; "off" then calls the modules one by one on those views — the same arithmetic as never merged.
"""
import argparse
import time

import torch

from modeling_weaver import cli
from modeling_weaver import target as target_module
from modeling_weaver.lab.benchmark import autoregressive_generate
from modeling_weaver.generate import speculative_generate


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli._add_demo_arguments(parser)
    parser.add_argument("--pairs", type=cli.positive_int, default=3)
    args = parser.parse_args()
    model, drafter, weaver, _, prompts = cli._real_setup(args)
    eos = model.generation_config.eos_token_id
    new_tokens = args.max_new_tokens or 64
    mergeable = target_module.SharedInputLinears._mergeable

    def rates(merge: bool) -> tuple[float, float]:
        target_module.SharedInputLinears._mergeable = staticmethod(mergeable if merge else (lambda linears: False))
        ar_s = spec_s = 0.0
        tokens = 0
        for ids in prompts:
            start = time.perf_counter()
            ref = autoregressive_generate(model, ids, new_tokens, eos_token_id=eos)
            ar_s += time.perf_counter() - start
            start = time.perf_counter()
            out = speculative_generate(model, ids, drafter=drafter, weaver=weaver, mode=args.mode,
                                       tree_budget=args.tree_budget, max_new_tokens=new_tokens, eos_token_id=eos)
            spec_s += time.perf_counter() - start
            if not torch.equal(out, ref):
                raise SystemExit("speculative output differs from AR")
            tokens += ref.shape[1] - ids.shape[1]
        return tokens / ar_s, tokens / spec_s

    try:
        for pair in range(args.pairs):
            for merge in (True, False) if pair % 2 else (False, True):
                ar, spec = rates(merge)
                print(f"pair {pair} merged={merge}: AR {ar:.1f} tok/s, {args.mode} {spec:.1f} tok/s "
                      f"({spec / ar:.2f}x)", flush=True)
    finally:
        target_module.SharedInputLinears._mergeable = mergeable


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""The tree phase inside the decoding loop on a CPU: DDTree, the Weaver through the native CPU kernels, and the
Weaver through the torch references, interleaved prompt by prompt (greedy ``speculative_generate``, the shipped
SmolLM2 pair with the drafters in their CPU dtype, the CPU's default budget and policy). Inside the loop a build costs
more than in a warm replay of recorded steps (the target's pass has evicted the caches), so this is the figure to
compare. Two passes, the second timed; every output is checked against ``target.generate`` (greedy, identical).

    PYTHONPATH=$PWD:$PWD/kernels python scripts/bench_cpu_tree_loop.py --per-dataset 4 --max-new-tokens 64
"""

import argparse
import statistics
import time
from collections import defaultdict

import torch
from transformers import AutoModel

import modeling_weaver.decoding.drafting as drafting
from modeling_weaver import speculative_generate
from modeling_weaver.cli import DEFAULT_SHIPPED_DRAFTERS
from modeling_weaver.lab import smollm2
from modeling_weaver.lab.data import chat_prompt_ids, load_eval_prompts
from modeling_weaver.options import TreePolicy
from weaver_kernels.weaver_tree import cpu as native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-dataset", type=int, default=4, help="first N MT-Bench and N HumanEval prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--spine-rounds", action="append", type=int, default=None, metavar="N",
                    help="Weaver rounds after the spine (repeat to compare; default: the device's own)")
    args = ap.parse_args()
    cpu = torch.device("cpu")
    target, tokenizer = smollm2.load_target("smollm2", dtype=torch.float32, device=cpu)
    dtype = smollm2.resolve_drafter_dtype("auto", cpu, torch.float32)
    drafter, weaver = (AutoModel.from_pretrained(DEFAULT_SHIPPED_DRAFTERS / part, trust_remote_code=True, dtype=dtype)
                       for part in ("dflash", "weaver"))
    variants = {"DDTree": ("ddtree", TreePolicy(), True)}
    for rounds in args.spine_rounds or [None]:
        label = "" if args.spine_rounds is None else f", {rounds} rounds after the spine"
        variants[f"Weaver, native kernels{label}"] = ("weaver", TreePolicy(spine_rounds=rounds), True)
        variants[f"Weaver, torch references{label}"] = ("weaver", TreePolicy(spine_rounds=rounds), False)
    built = native.available()
    spent, steps = defaultdict(list), defaultdict(int)
    now = {"variant": None}
    original = drafting.tree_drafts

    def timed(*a, **k):
        start = time.perf_counter()
        out = original(*a, **k)
        if now["variant"] is not None:
            spent[now["variant"]].append(time.perf_counter() - start)
        return out

    drafting.tree_drafts = timed
    wall, tokens = defaultdict(float), defaultdict(int)
    prompts = [p.text for items in load_eval_prompts().values() for p in items[:args.per_dataset]]
    for timed_pass in (False, True):
        for text in prompts:
            ids = torch.tensor([chat_prompt_ids(tokenizer, text)])
            start = time.perf_counter()
            ref = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
            if timed_pass:
                wall["target.generate"] += time.perf_counter() - start
                tokens["target.generate"] += ref.shape[1] - ids.shape[1]
            for name, (mode, policy, use_native) in variants.items():
                native.available = (lambda: built) if use_native else (lambda: False)
                now["variant"] = name if timed_pass else None
                start = time.perf_counter()
                out, stats = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode,
                                                  tree_policy=policy, max_new_tokens=args.max_new_tokens,
                                                  return_stats=True)
                now["variant"] = None
                if not torch.equal(out, ref):
                    raise SystemExit(f"{name}: output differs from target.generate")
                if timed_pass:
                    wall[name] += time.perf_counter() - start
                    tokens[name] += out.shape[1] - ids.shape[1]
                    steps[name] += stats.num_steps
    print(f"every output identical to target.generate; native kernels built: {built}")
    print(f"target.generate: {tokens['target.generate'] / wall['target.generate']:.1f} tok/s")
    for name in variants:
        t = spent[name]
        print(f"{name}: tree phase median {1e3 * statistics.median(t):.2f} ms, mean {1e3 * statistics.mean(t):.2f} ms "
              f"({len(t)} builds); {tokens[name] / wall[name]:.1f} tok/s, {tokens[name] / steps[name]:.2f} tokens "
              f"per step")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Our default ``speculative_generate`` against ``target.generate`` (HF defaults), greedy, on SmolLM2 with the shipped
pair (or each --pair, side by side in one run): tokens/s of each per prompt, identical output checked (issue #28's
comparison; CPU by default).

    PYTHONPATH=$PWD:$PWD/kernels python scripts/speed_vs_hf.py --per-dataset 4 --max-new-tokens 128 --mode weaver --mode ddtree
"""

import argparse
import time

import torch
from transformers import AutoModel

from modeling_weaver import speculative_generate
from modeling_weaver.cli import DEFAULT_SHIPPED_DRAFTERS
from modeling_weaver.lab import smollm2
from modeling_weaver.lab.data import chat_prompt_ids, load_eval_prompts
from modeling_weaver.options import BudgetPolicy, TreePolicy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-dataset", type=int, default=8, help="first N MT-Bench and N HumanEval prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--mode", action="append", default=None, choices=("weaver", "ddtree", "chain"),
                    help="tree mode (repeat to compare; default: weaver)")
    ap.add_argument("--dtype", default="float32", help="of the target, drafter and Weaver")
    ap.add_argument("--drafter-dtype", default=None,
                    help="of the drafter and Weaver (default: --dtype; auto: bf16 where the CPU has bf16 matmuls, as "
                         "the demo and weaver bench load them)")
    ap.add_argument("--pair", action="append", default=None, metavar="DIR",
                    help="a folder with dflash/ and weaver/ (repeat to compare; default: the shipped pair)")
    ap.add_argument("--tree-budget", action="append", default=None, metavar="N|auto",
                    help="tree budget (repeat to compare; default: speculative_generate's own default)")
    ap.add_argument("--spine-rounds", action="append", type=int, default=None, metavar="N",
                    help="Weaver rounds after the spine (TreePolicy.spine_rounds; repeat to compare; default: the "
                         "device's own)")
    ap.add_argument("--pool-size", action="append", type=int, default=None, metavar="N",
                    help="DFlash candidates per depth the Weaver scores (TreePolicy.pool_size; repeat to compare; "
                         "default: the device's own)")
    ap.add_argument("--auto-max-size", type=int, default=None, metavar="N",
                    help='tree_budget="auto": the largest tree it builds (BudgetPolicy.max_size; default its own)')
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    target, tokenizer = smollm2.load_target("smollm2", dtype=dtype, device=torch.device("cpu"))
    budgets = [None if b is None else b if b == "auto" else int(b) for b in args.tree_budget or [None]]
    drafter_dtype = dtype if args.drafter_dtype is None else smollm2.resolve_drafter_dtype(
        args.drafter_dtype, torch.device("cpu"), dtype)
    models = {folder: tuple(AutoModel.from_pretrained(f"{folder}/{part}", trust_remote_code=True, dtype=drafter_dtype)
                            for part in ("dflash", "weaver"))
              for folder in args.pair or [str(DEFAULT_SHIPPED_DRAFTERS)]}
    modes = args.mode or ["weaver"]
    rounds = [(r, pool) for r in args.spine_rounds or [None] for pool in args.pool_size or [None]]
    runs = {(folder, budget, r, mode): pair for folder, pair in models.items() for budget in budgets for r in rounds
            for mode in modes}
    policy = {r: TreePolicy(spine_rounds=r[0], pool_size=r[1]) for r in rounds}
    sizing = {b: BudgetPolicy(max_size=args.auto_max_size) if b == "auto" and args.auto_max_size else None
              for b in budgets}
    warm = torch.tensor([chat_prompt_ids(tokenizer, "Hello")])  # one-time costs (packing, calibration) untimed
    target.generate(warm, max_new_tokens=4, do_sample=False)
    for (folder, budget, r, mode), (drafter, weaver) in runs.items():
        speculative_generate(target, warm, drafter=drafter, weaver=weaver, mode=mode, tree_budget=budget,
                             tree_policy=policy[r], budget_policy=sizing[budget], max_new_tokens=4)
    names = {run: " ".join(x for x in (run[0] if len(models) > 1 else "",
                                       f"budget {run[1]}" if len(budgets) > 1 else "",
                                       f"rounds {run[2][0]} pool {run[2][1]}" if len(rounds) > 1 else "",
                                       run[3] if len(modes) > 1 else "") if x) for run in runs}
    ratios, mals = {run: [] for run in runs}, {run: [] for run in runs}
    hf_total, ours_total = 0.0, dict.fromkeys(runs, 0.0)
    for dataset, items in load_eval_prompts().items():
        for p in items[:args.per_dataset]:
            ids = torch.tensor([chat_prompt_ids(tokenizer, p.text)])
            start = time.perf_counter()
            ref = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
            hf = time.perf_counter() - start
            n = ref.shape[1] - ids.shape[1]
            hf_total += hf
            line = f"{dataset} {p.id}: {n} tokens, HF {n / hf:.2f} tok/s"
            for run, (drafter, weaver) in runs.items():
                start = time.perf_counter()
                out, stats = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=run[3],
                                                  tree_budget=run[1], tree_policy=policy[run[2]],
                                                  budget_policy=sizing[run[1]],
                                                  max_new_tokens=args.max_new_tokens,
                                                  return_stats=True)
                ours = time.perf_counter() - start
                ratios[run].append(hf / ours)
                mals[run].append(stats.mean_accepted_length)
                ours_total[run] += ours
                name = f" [{names[run]}]" if names[run] else ""
                line += (f"; ours{name} {n / ours:.2f} tok/s = {hf / ours:.2f}x, MAL {stats.mean_accepted_length:.2f},"
                         f" identical {torch.equal(out, ref)}")
            print(line, flush=True)
    for run in runs:
        name = f"{names[run]}: " if names[run] else ""
        print(f"{name}overall {hf_total / ours_total[run]:.2f}x (time-weighted), per prompt "
              f"{min(ratios[run]):.2f}-{max(ratios[run]):.2f}x, MAL {sum(mals[run]) / len(mals[run]):.3f} "
              f"(mean over prompts)")

if __name__ == "__main__":
    main()

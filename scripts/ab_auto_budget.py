"""tree_budget="auto" against fixed budgets and AR on the shipped SmolLM2 pair, interleaved in one process.

    python scripts/ab_auto_budget.py --prompts 3 --max-new-tokens 64 --reps 2 --threads 1

Every (rep, prompt) runs each method once, in a shuffled order, so a shared machine's slow spells hit them alike;
printed: the median tokens/s per method, its ratio to AR, MAL, the tree sizes auto chose, the step costs it used
(measured in the warm-up unless cached in ``--cache-dir``), and whether every greedy output equals AR's.
"""
import argparse
import random
import statistics
import time

import torch

from modeling_weaver import BudgetPolicy, speculative_generate
from modeling_weaver.cli import _DEMO_PROMPTS, DEFAULT_SHIPPED_DRAFTERS, positive_int
from modeling_weaver.convert import load_dflash, load_weaver
from modeling_weaver.lab.benchmark import autoregressive_generate
from modeling_weaver.lab.smollm2 import load_target, resolve_drafter_dtype
from modeling_weaver.packed import pack_cpu_linears

EXTRA_PROMPTS = ("Summarise the plot of Romeo and Juliet in a few sentences.",)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=positive_int, default=3, help="the demo's prompts, then one more (at most 4)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64)
    parser.add_argument("--reps", type=positive_int, default=2)
    parser.add_argument("--budgets", type=positive_int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--modes", nargs="+", default=["ddtree", "weaver"], choices=("chain", "ddtree", "weaver"))
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--cache-dir", default=None, help="step-cost cache folder (default: the cache folder)")
    parser.add_argument("--recalibrate", action="store_true", help="measure the step costs again")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, new = torch.device("cpu"), args.max_new_tokens
    target, tokenizer = load_target("smollm2", dtype=torch.float32, device=device)
    drafter_dtype = resolve_drafter_dtype("auto", device, torch.float32)
    drafter = load_dflash(DEFAULT_SHIPPED_DRAFTERS / "dflash", dtype=drafter_dtype, device=device)
    weaver = load_weaver(DEFAULT_SHIPPED_DRAFTERS / "weaver", dtype=torch.float32, device=device)
    print(f"{pack_cpu_linears(target, drafter, weaver)} linears packed, {torch.get_num_threads()} threads")
    texts = (_DEMO_PROMPTS + EXTRA_PROMPTS)[:args.prompts]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"] for t in texts]
    eos = target.generation_config.eos_token_id
    methods = [("ar", None)] + [(m, b) for m in args.modes for b in (*args.budgets, "auto")]

    def run(method, ids, policy=None):
        mode, budget = method
        start = time.perf_counter()
        if mode == "ar":
            out = autoregressive_generate(target, ids, new, eos_token_id=eos)
            return time.perf_counter() - start, out, None
        out, stats = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget=budget,
                                          max_new_tokens=new, eos_token_id=eos, return_stats=True,
                                          budget_policy=(policy or BudgetPolicy(cache_dir=args.cache_dir))
                                          if budget == "auto" else None)
        return time.perf_counter() - start, out, stats

    for method in methods:  # warm-up; auto measures its step costs here unless they are cached
        policy = BudgetPolicy(cache_dir=args.cache_dir, recalibrate=args.recalibrate)
        _, _, stats = run(method, prompts[0], policy)
        if stats is not None and stats.calibration:
            costs = stats.calibration["costs"]
            print(f"{method[0]} auto step costs ({costs['source']}): verify+accept+commit ms by draft nodes "
                  f"{costs['verify_ms']}, draft+tree {costs['propose_ms']} ms")
    expected = [autoregressive_generate(target, ids, new, eos_token_id=eos) for ids in prompts]
    rates = {m: [] for m in methods}
    mal = {m: [] for m in methods}
    sizes = {m: {} for m in methods}
    same = {m: True for m in methods}
    order = random.Random(0)
    for rep in range(args.reps):
        for p, ids in enumerate(prompts):
            for method in order.sample(methods, len(methods)):
                seconds, out, stats = run(method, ids)
                rates[method].append((out.shape[1] - ids.shape[1]) / seconds)
                same[method] &= torch.equal(out, expected[p])
                if stats is not None:
                    mal[method].append(stats.mean_accepted_length)
                    for size, n in stats.size_histogram.items():
                        sizes[method][size] = sizes[method].get(size, 0) + n
    ar = statistics.median(rates[("ar", None)])
    print(f"{'method':12s} {'tok/s':>6s} {'×AR':>5s} {'MAL':>5s}  sizes chosen (draft nodes: steps)")
    for method in methods:
        rate = statistics.median(rates[method])
        label = method[0] if method[1] is None else f"{method[0]}@{method[1]}"
        print(f"{label:12s} {rate:6.1f} {rate / ar:5.2f} {statistics.mean(mal[method] or [1.0]):5.2f}  "
              f"{sizes[method] if method[1] == 'auto' else ''}")
    print("greedy outputs identical to AR:", all(same.values()), "" if all(same.values()) else same)
    print("tokens/s per run:", {f"{m}@{b}" if b else m: [round(r, 1) for r in v] for (m, b), v in rates.items()})


if __name__ == "__main__":
    main()

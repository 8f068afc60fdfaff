"""When auto should skip drafting: candidate skip rules replayed offline on recorded auto steps (shipped SmolLM2 pair).

    python scripts/skip_rule_offline.py record --out steps.json [--modes ddtree weaver] [--subset 8]
    python scripts/skip_rule_offline.py rules steps.json

``record`` runs ``tree_budget="auto"`` with ``max_backoff=0`` (every step drafts) on the bench prompts (MT-Bench and
HumanEval, ``--subset`` each, 128 new tokens) and writes, per step, the expected length and steady rate of every
candidate size, the size verified and the length accepted, with the generation's cost table. ``rules`` replays each
rule on those steps: a rule that skips ``n`` drafts replaces them by ``n`` AR steps (``n`` tokens at the AR cost) and
drops the recorded steps those tokens cover (approximate: the accepted lengths of the steps after a skip are taken as
recorded). Printed: tokens/ms per dataset relative to never skipping, and the worst prompt.
"""
import argparse
import json

from modeling_weaver.decoding.budget import AutoBudget, CostTable
from modeling_weaver.options import BudgetPolicy


def record(args):
    import torch

    from modeling_weaver import speculative_generate
    from modeling_weaver.cli import DEFAULT_SHIPPED_DRAFTERS
    from modeling_weaver.convert import load_dflash, load_weaver
    from modeling_weaver.decoding import budget
    from modeling_weaver.lab.data import load_eval_prompts
    from modeling_weaver.lab.smollm2 import load_target, resolve_drafter_dtype
    from modeling_weaver.packed import pack_cpu_linears

    device = torch.device("cpu")
    target, tokenizer = load_target("smollm2", dtype=torch.float32, device=device)
    drafter = load_dflash(DEFAULT_SHIPPED_DRAFTERS / "dflash", device=device,
                          dtype=resolve_drafter_dtype("auto", device, torch.float32))
    weaver = load_weaver(DEFAULT_SHIPPED_DRAFTERS / "weaver", dtype=torch.float32, device=device)
    pack_cpu_linears(target, drafter, weaver)
    steps, choose, observe = [], budget.AutoBudget.choose, budget.AutoBudget.observe

    def recorded_choose(self, tree):
        nodes = budget.best_first(tree.parents.tolist(), tree.logq.tolist())
        lengths = budget.expected_lengths(nodes, self.sizes, self.factors())
        cut = choose(self, tree)
        steps.append({"lengths": lengths, "rates": budget.steady_rates(self.sizes, lengths, self.costs, len(nodes)),
                      "chosen": len(cut) - 1})
        return cut

    def recorded_observe(self, accepted):
        steps[-1]["accepted"] = accepted
        return observe(self, accepted)

    budget.AutoBudget.choose, budget.AutoBudget.observe = recorded_choose, recorded_observe
    runs = []
    for mode in args.modes:
        for dataset, items in load_eval_prompts(["mtbench", "humaneval"]).items():
            for prompt in items[:args.subset]:
                ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}], return_tensors="pt",
                                                    add_generation_prompt=True, return_dict=True)["input_ids"]
                steps = []
                _, stats = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode,
                                                tree_budget="auto", max_new_tokens=128, return_stats=True,
                                                eos_token_id=target.generation_config.eos_token_id,
                                                budget_policy=BudgetPolicy(max_backoff=0))
                runs.append({"mode": mode, "dataset": dataset, "id": prompt.id, "steps": steps,
                             "sizes": list(stats.calibration["sizes"]), "costs": stats.calibration["costs"]})
                print(mode, dataset, prompt.id, f"MAL {stats.mean_accepted_length:.2f}", flush=True)
    with open(args.out, "w") as f:
        json.dump(runs, f)


def replay(run, skip_after: int, max_backoff: int):
    """``(ms, tokens)`` of one recorded generation, the skips decided by :meth:`AutoBudget.steady` itself under
    ``BudgetPolicy(skip_after=..., max_backoff=...)`` (``max_backoff=0``: never skip)."""
    costs = CostTable(tuple((int(k), v) for k, v in run["costs"]["verify_ms"].items()), run["costs"]["propose_ms"])
    sizes, steps, ar_ms = run["sizes"], run["steps"], costs.verify(0)
    sizer = AutoBudget(BudgetPolicy(skip_after=skip_after, max_backoff=max_backoff), costs, tuple(sizes), 1)
    ms = tokens = i = 0
    while i < len(steps):
        step = steps[i]
        ms, tokens, i = ms + costs.propose_ms + costs.verify(step["chosen"]), tokens + step["accepted"], i + 1
        sizer.steady(sizes[step["rates"].index(max(step["rates"]))] == 0, step["chosen"] == 0)
        skipped, sizer.skip = sizer.skip, 0
        ms, tokens, covered = ms + skipped * ar_ms, tokens + skipped, 0
        while i < len(steps) and covered < skipped:
            covered, i = covered + steps[i]["accepted"], i + 1
    return ms, tokens


#: candidate rules as ``skip_after``: AR as the steady choice that many drafting steps in a row (or once with the
#: drafted tree cut to its root) skips the next drafts
RULES = {
    "one AR verdict": 1,
    "one AR verdict, tree cut to its root": 10**9,
    "two AR verdicts in a row": 2,
    "three AR verdicts in a row": 3,
}


def rules(args):
    with open(args.steps) as f:
        runs = json.load(f)
    never = [(tokens / ms) for ms, tokens in (replay(run, 1, 0) for run in runs)]  # tokens/ms with no skip
    for mode in dict.fromkeys(r["mode"] for r in runs):
        print(f"## {mode} (tokens/ms relative to never skipping)")
        for name, skip_after in RULES.items():
            for cap in args.max_backoff:
                rel = {}
                for run, base in ((r, b) for r, b in zip(runs, never) if r["mode"] == mode):
                    ms, tokens = replay(run, skip_after, cap)
                    rel.setdefault(run["dataset"], []).append((tokens / ms) / base)
                means = " ".join(f"{ds} {sum(v) / len(v):.4f}" for ds, v in rel.items())
                print(f"{name:40s} max_backoff {cap:2d}: {means}, worst {min(min(v) for v in rel.values()):.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--out", required=True)
    rec.add_argument("--modes", nargs="+", default=["ddtree", "weaver"], choices=("chain", "ddtree", "weaver"))
    rec.add_argument("--subset", type=int, default=8)
    rul = sub.add_parser("rules")
    rul.add_argument("steps")
    rul.add_argument("--max-backoff", type=int, nargs="+", default=[4, 16])
    args = parser.parse_args()
    (record if args.command == "record" else rules)(args)


if __name__ == "__main__":
    main()

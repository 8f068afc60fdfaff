"""Mean accepted length of Weaver trees against the expansion width of best-first rounds, the rounds after a spine, or
a tempering of the Weaver's scores (default trees), on real SmolLM2 with the shipped drafters.

    python scripts/weaver_width_sweep.py --budget 64 --widths 1 4 8 16
    python scripts/weaver_width_sweep.py --budget 64 --calibrations 1,1 0.7,1 1.5,1 1,0.5 1,1.5
    python scripts/weaver_width_sweep.py --budget 64 --widths 4 --spines 4,8 2,8 3,4
    python scripts/weaver_width_sweep.py --budget 64 --fans 8 16 32

Greedy, the first ``--subset`` MT-Bench and HumanEval prompts, ``--max-new-tokens`` each (CPU is fine); only the
proposal changes, every output stays the target's greedy text. Fewer, wider rounds are cheaper on a GPU; the widths
show what they cost in MAL. (On a replay at a larger target's depth also check that the trees still reach the traced
depths: a node of depth d needs d rounds.) ``--calibrations tau,alpha ...`` scores the candidates
``(dflash + alpha · residual) / tau`` instead of ``dflash + residual`` (the Weaver as trained: ``1,1``): is the
best-first allocation calibrated? ``--spines rounds,width ...`` builds the trees from DFlash's chain first
(``TreePolicy.spine``) with that many rounds of that width after it. ``--fans f ...``: the default trees with
``f`` children published per stepped node (``TreePolicy.children_per_node``); ``--root-children r ...``: with the
root offering ``r`` (``TreePolicy.root_children``). ``--int8-draft-head``: every tree from draft logits through the
int8 copy of the lm_head (``StepOptions.int8_head``; the CPU reference is slow).
"""
import argparse
from pathlib import Path

import torch
import weaver_kernels
from transformers import AutoModel

import modeling_weaver.tree as tree_module
from modeling_weaver.cli import nonnegative_int, positive_int
from modeling_weaver import speculative_generate
from modeling_weaver.lab.data import chat_prompt_ids, load_eval_prompts
from modeling_weaver.options import StepOptions, TreePolicy
from modeling_weaver.lab.smollm2 import load_smollm2

SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "smollm2-135m-instruct"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=positive_int, default=64)
    parser.add_argument("--widths", type=positive_int, nargs="+", default=[])
    parser.add_argument("--calibrations", nargs="+", default=[], metavar="TAU,ALPHA")
    parser.add_argument("--spines", nargs="+", default=[], metavar="ROUNDS,WIDTH",
                        help="trees from DFlash's chain first, then ROUNDS rounds of WIDTH (TreePolicy.spine)")
    parser.add_argument("--fans", type=positive_int, nargs="+", default=[],
                        help="default trees with this many children published per stepped node (TreePolicy.children_per_node)")
    parser.add_argument("--root-children", type=nonnegative_int, nargs="+", default=[],
                        help="default trees whose root offers this many children (TreePolicy.root_children)")
    parser.add_argument("--int8-draft-head", action="store_true",
                        help="the drafter projects with the int8 copy of the lm_head (StepOptions.int8_head)")
    parser.add_argument("--subset", type=positive_int, default=4)
    parser.add_argument("--max-new-tokens", type=positive_int, default=96)
    args = parser.parse_args()
    if not any((args.widths, args.calibrations, args.spines, args.fans, args.root_children)):
        args.widths = [1, 4, 8, 16]
    options = StepOptions(int8_head=args.int8_draft_head)  # (off unless asked, on CUDA too)
    model, tokenizer = load_smollm2()
    drafter = AutoModel.from_pretrained(SHIPPED / "dflash", trust_remote_code=True)
    weaver = AutoModel.from_pretrained(SHIPPED / "weaver", trust_remote_code=True)
    prompts = load_eval_prompts()
    ids = [torch.tensor([chat_prompt_ids(tokenizer, p.text)]) for name in ("mtbench", "humaneval")
           for p in prompts[name][: args.subset]]

    def mal(label: str, policy: TreePolicy = TreePolicy()) -> None:
        lengths = []
        for x in ids:
            _, stats = speculative_generate(model, x, drafter=drafter, weaver=weaver, mode="weaver",
                                            tree_budget=args.budget, max_new_tokens=args.max_new_tokens,
                                            return_stats=True, tree_policy=policy, step_options=options)
            lengths += stats.accepted_lengths
        print(f"budget {args.budget} {label}: MAL {sum(lengths) / len(lengths):.3f} over {len(lengths)} steps",
              flush=True)

    build, scores = tree_module.weaver_tree_tensors, weaver_kernels.pool_scores
    try:
        for width in args.widths:
            tree_module.weaver_tree_tensors = lambda *a, w=width, **k: build(*a, **{**k, "width": w, "spine": False})
            mal(f"best-first, width {width}")
        for pair in args.spines:
            rounds, width = map(int, pair.split(","))
            tree_module.weaver_tree_tensors = lambda *a, r=rounds, w=width, **k: build(
                *a, **{**k, "width": w, "spine": True, "rounds": r})
            mal(f"spine + {rounds} rounds of {width}")
        tree_module.weaver_tree_tensors = build
        for fan in args.fans:
            mal(f"{fan} children per node", TreePolicy(children_per_node=fan))
        for root in args.root_children:
            mal(f"{root} children of the root", TreePolicy(root_children=root))
        for pair in args.calibrations:
            tau, alpha = map(float, pair.split(","))

            def tempered(query, rows, pool_ids, pool_logits, weight, tau=tau, alpha=alpha):
                base = pool_logits[rows].float()
                return (base + alpha * (scores(query, rows, pool_ids, pool_logits, weight) - base)) / tau
            weaver_kernels.pool_scores = tempered
            mal(f"tau {tau} alpha {alpha}")
    finally:
        tree_module.weaver_tree_tensors, weaver_kernels.pool_scores = build, scores


if __name__ == "__main__":
    main()

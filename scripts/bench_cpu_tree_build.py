#!/usr/bin/env python
"""Per-step tree-build time on CPU, Weaver against DDTree, side by side in one process: the inputs of real steps (the
shipped SmolLM2 pair, greedy, the default CPU budget and packed linears) are recorded from a few generations, then
each step's tree is built by each mode in turn, interleaved, and the medians reported (contention hits both alike).

    PYTHONPATH=$PWD:$PWD/kernels python scripts/bench_cpu_tree_build.py --prompts 2 --repeats 5
"""

import argparse
import statistics
import time

import torch
from transformers import AutoModel

import modeling_weaver.decoding.drafting as drafting
from modeling_weaver import speculative_generate
from modeling_weaver.cli import DEFAULT_SHIPPED_DRAFTERS
from modeling_weaver.lab import smollm2
from modeling_weaver.lab.data import chat_prompt_ids, load_eval_prompts
from modeling_weaver.packed import packed_cpu_linears
from modeling_weaver.tree import tree_drafts, with_root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=2, help="first N MT-Bench and N HumanEval prompts recorded")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5, help="builds of every recorded step per mode")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    target, tokenizer = smollm2.load_target("smollm2", dtype=torch.float32, device=torch.device("cpu"))
    drafter = AutoModel.from_pretrained(DEFAULT_SHIPPED_DRAFTERS / "dflash", trust_remote_code=True,
                                        dtype=torch.float32)
    weaver = AutoModel.from_pretrained(DEFAULT_SHIPPED_DRAFTERS / "weaver", trust_remote_code=True,
                                       dtype=torch.float32)
    steps, build = [], drafting.tree_drafts

    def record(mode, root, hidden, logits, budget, weaver, last_hidden, *rest, **options):
        steps.append((root, hidden.clone(), logits.clone(), budget, last_hidden.clone()))
        return build(mode, root, hidden, logits, budget, weaver, last_hidden, *rest, **options)

    drafting.tree_drafts = record
    try:
        for items in load_eval_prompts().values():
            for p in items[:args.prompts]:
                ids = torch.tensor([chat_prompt_ids(tokenizer, p.text)])
                speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode="weaver",
                                     max_new_tokens=args.max_new_tokens)
    finally:
        drafting.tree_drafts = build
    embed, head = target.get_input_embeddings(), target.get_output_embeddings().weight
    times: dict[str, list[float]] = {"weaver": [], "ddtree": []}
    with packed_cpu_linears(target, weaver):  # (as inside a generation on CPU)
        for repeat in range(args.repeats + 1):
            for root, hidden, logits, budget, last_hidden in steps:
                for mode, spans in times.items():
                    start = time.perf_counter()
                    with_root(root, tree_drafts(mode, root, hidden, logits, budget, weaver, last_hidden, embed, head))
                    if repeat:  # (the first pass warms up)
                        spans.append(time.perf_counter() - start)
    medians = {mode: 1e3 * statistics.median(spans) for mode, spans in times.items()}
    each = ", ".join(f"{mode} {ms:.2f} ms" for mode, ms in medians.items())
    print(f"{len(steps)} steps (budget {steps[0][3]}), {args.repeats} builds each: {each}; "
          f"Weaver/DDTree {medians['weaver'] / medians['ddtree']:.1f}x")


if __name__ == "__main__":
    main()

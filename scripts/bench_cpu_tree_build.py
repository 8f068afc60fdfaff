#!/usr/bin/env python
"""Per-step tree-build time on CPU, Weaver against DDTree, side by side in one process: the inputs of real steps (the
shipped SmolLM2 pair, greedy, the default CPU budget and packed linears) are recorded from a few generations, then
each step's tree is built by each variant in turn, interleaved, and the medians reported (contention hits all alike).
Variants: DDTree, the Weaver in fp32 and, where bf16 matmuls are native, in bf16 (the drafters' dtype there), each
through the native CPU kernels where they build; ``--parts`` adds where a bf16 (else fp32) Weaver build through the
torch references spends its time (the native build has no such parts). Warm replays flatter a build: inside the loop
it costs more (``scripts/bench_cpu_tree_loop.py``).

    PYTHONPATH=$PWD:$PWD/kernels python scripts/bench_cpu_tree_build.py --prompts 2 --repeats 5 --parts
"""

import argparse
import contextlib
import statistics
import time
from collections import defaultdict
from unittest import mock

import torch
import weaver_kernels
from transformers import AutoModel

import modeling_weaver.decoding.drafting as drafting
import modeling_weaver.tree as tree_module
from modeling_weaver import speculative_generate
from modeling_weaver.cli import DEFAULT_SHIPPED_DRAFTERS
from modeling_weaver.lab import smollm2
from modeling_weaver.lab.data import chat_prompt_ids, load_eval_prompts
from modeling_weaver.packed import packed_cpu_linears
from modeling_weaver.tree import tree_drafts, with_root
from weaver_kernels.weaver_tree import cpu as native


def timed_parts(weaver, stack: contextlib.ExitStack) -> dict:
    """Wrap the Weaver build's parts with wall-clock timers while ``stack`` is open: ms per part."""
    spent = defaultdict(float)
    for owner, name in ((weaver, "encode_prompt"), (weaver, "node_inputs"), (weaver, "step"),
                        (weaver_kernels, "pool_scores"), (weaver_kernels, "weaver_expand"),
                        (tree_module, "best_known"), (tree_module, "weaver_tree_tensors")):
        def wrapper(*args, _original=getattr(owner, name), _name=name, **kwargs):
            start = time.perf_counter()
            out = _original(*args, **kwargs)
            spent[_name] += 1e3 * (time.perf_counter() - start)
            return out

        stack.enter_context(mock.patch.object(owner, name, wrapper))
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=2, help="first N MT-Bench and N HumanEval prompts recorded")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5, help="builds of every recorded step per variant")
    ap.add_argument("--parts", action="store_true", help="also time the parts of the Weaver's build")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    cpu = torch.device("cpu")
    target, tokenizer = smollm2.load_target("smollm2", dtype=torch.float32, device=cpu)
    drafter_dtype = smollm2.resolve_drafter_dtype("auto", cpu, torch.float32)
    drafter = AutoModel.from_pretrained(DEFAULT_SHIPPED_DRAFTERS / "dflash", trust_remote_code=True,
                                        dtype=drafter_dtype)
    weavers = {torch.float32: None, drafter_dtype: None}
    for dtype in weavers:
        weavers[dtype] = AutoModel.from_pretrained(DEFAULT_SHIPPED_DRAFTERS / "weaver", trust_remote_code=True,
                                                   dtype=dtype)
    steps, build = [], drafting.tree_drafts

    def record(mode, root, hidden, logits, budget, weaver, last_hidden, *rest, **options):
        steps.append((root, hidden.clone(), logits.clone(), budget, last_hidden.clone()))
        return build(mode, root, hidden, logits, budget, weaver, last_hidden, *rest, **options)

    with mock.patch.object(drafting, "tree_drafts", record):
        for items in load_eval_prompts().values():
            for p in items[:args.prompts]:
                ids = torch.tensor([chat_prompt_ids(tokenizer, p.text)])
                speculative_generate(target, ids, drafter=drafter, weaver=weavers[drafter_dtype], mode="weaver",
                                     max_new_tokens=args.max_new_tokens)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings().weight
    variants = {"ddtree": ("ddtree", None)} | {f"weaver {str(d).removeprefix('torch.')}": ("weaver", w)
                                                for d, w in weavers.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    with packed_cpu_linears(target, *weavers.values()):  # (as inside a generation on CPU)
        for repeat in range(args.repeats + 1):
            for root, hidden, logits, budget, last_hidden in steps:
                for name, (mode, weaver) in variants.items():
                    start = time.perf_counter()
                    with_root(root, tree_drafts(mode, root, hidden, logits, budget, weaver, last_hidden, embed, head))
                    if repeat:  # (the first pass warms up)
                        times[name].append(time.perf_counter() - start)
        medians = {name: 1e3 * statistics.median(spans) for name, spans in times.items()}
        each = ", ".join(f"{name} {ms:.2f} ms ({ms / medians['ddtree']:.1f}x DDTree)" for name, ms in medians.items())
        print(f"{len(steps)} steps (budget {steps[0][3]}), {args.repeats} builds each: {each}")
        if args.parts:
            weaver = weavers[drafter_dtype]
            with contextlib.ExitStack() as stack:
                stack.enter_context(mock.patch.object(native, "available", lambda: False))  # (the references)
                spent = timed_parts(weaver, stack)
                for root, hidden, logits, budget, last_hidden in steps * args.repeats:
                    with_root(root, tree_drafts("weaver", root, hidden, logits, budget, weaver, last_hidden, embed,
                                                head))
            builds = len(steps) * args.repeats
            print(f"Weaver ({str(drafter_dtype).removeprefix('torch.')}) build parts, mean ms per build: " + ", ".join(
                f"{name} {ms / builds:.3f}" for name, ms in spent.items()) + " (weaver_tree_tensors holds the node "
                "steps, pool scores, expansions and the pick; encode_prompt runs before it)")


if __name__ == "__main__":
    main()

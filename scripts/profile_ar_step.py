"""Where the decode steps of a random-weight hub-spec target spend their GPU time (torch.profiler kernel tables).

    python scripts/profile_ar_step.py --shape qwen3.6-27b --tokens 8 --target-step compiled --proposer weaver

1. The AR step (verify of one node + commit) run ``--tokens`` times without CUDA graphs (``static``: eager
   fixed-shape ops; ``compiled``: the torch.compile'd tree pass and commit), so the profiler sees every kernel:
   GPU busy time per step and the kernel table.
2. With ``--graph-gap``: the fused AR step's CUDA graph replayed back to back (GPU time alone), and
   ``autoregressive_generate``'s pipelined loop (host work between steps included): the difference is the host gap.
3. With ``--proposer MODE``: one DFlash draft + tree build of that mode at ``--budget`` (compiled when the target
   step is), its kernel table.
4. With ``--tree-nodes N``: the verify of an N-node tree (a chain: the GEMMs cost the same for any shape) and the
   commit of a 4-node path, without graphs: what a speculative step's target pass spends beyond the AR step.
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from modeling_weaver.benchmark import autoregressive_generate
from modeling_weaver.captured import cache_bucket, static_draft, static_target
from modeling_weaver.replay import graph_replay_ms, random_models, random_prompt
from modeling_weaver.tree import Tree


def kernel_table(fn, reps: int, rows: int, title: str) -> None:
    fn()  # warm-up (compiles)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    busy = sum(e.device_time_total for e in events) / 1e3 / reps  # µs → ms
    count = sum(e.count for e in events) / reps
    print(f"\n## {title}: GPU busy {busy:.2f} ms per call, {count:.0f} kernels per call")
    print(events.table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3.6-27b")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=512)
    parser.add_argument("--target-step", choices=("static", "compiled"), default="static")
    parser.add_argument("--graph-gap", action="store_true")
    parser.add_argument("--proposer", choices=("chain", "ddtree", "weaver"))
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--tree-nodes", type=int)
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()
    compile = args.target_step == "compiled"
    target, drafter, weaver = random_models(args.shape, torch.device("cuda"), torch.bfloat16)
    ids = random_prompt(target, args.prompt_length)
    # One cache bucket (a power of two) for every call below, so that no timed call allocates, compiles or captures.
    max_length = cache_bucket(args.prompt_length + 4 * args.tokens + max(64, (args.tree_nodes or 0) + 4 * (args.tokens + 1)))
    new_tokens = max_length - args.prompt_length - 1  # autoregressive_generate's capacity: prompt + new + 1

    step = static_target(target, max_length, 1, capture=False, compile=compile)
    step.prefill(ids[0])
    one = Tree.from_lists([int(ids[0, -1])], [-1], device="cuda")

    def ar_step():
        step.verify(one)
        step.commit([0])

    kernel_table(ar_step, args.tokens, args.rows, f"AR step ({args.target_step}, no graphs)")

    if args.tree_nodes:
        tree_step = static_target(target, max_length, args.tree_nodes, capture=False, compile=compile)
        tree_step.prefill(ids[0])
        n = args.tree_nodes
        chain = Tree.from_lists(ids[0, -n:].tolist(), list(range(-1, n - 1)), device="cuda")

        def verify_step():
            tree_step.verify(chain)
            tree_step.commit([0, 1, 2, 3])

        kernel_table(verify_step, args.tokens, args.rows, f"{n}-node verify + 4-node commit ({args.target_step}, "
                     "no graphs)")

    if args.graph_gap:
        target_step = "compiled" if compile else "graph"
        autoregressive_generate(target, ids, new_tokens, eos_token_id=[], target_step=target_step)  # captures
        graph = static_target(target, max_length, 1, capture=True, compile=compile)
        graph.prefill(ids[0])
        reps = 4 * args.tokens
        replay_ms, _ = graph_replay_ms(graph.ar_step()._graph[0], reps)  # the fused AR step: verify+commit+argmax
        lengths, seconds = (new_tokens - reps, new_tokens), []  # both in the bucket: their difference is `reps` steps
        for n in lengths:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            autoregressive_generate(target, ids, n, eos_token_id=[], target_step=target_step)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
        per_token = 1e3 * (seconds[1] - seconds[0]) / reps
        print(f"\n## AR graph replays back to back: {replay_ms:.2f} ms per step; in the generate loop: "
              f"{per_token:.2f} ms per token → host gap {per_token - replay_ms:.2f} ms per step")

    if args.proposer:
        draft = static_draft(drafter, target, max_length, capture=False)
        proposer = draft.proposer(args.proposer, args.budget, weaver if args.proposer == "weaver" else None,
                                  compile=compile)
        context = torch.randn(drafter.block_size, drafter.fc.in_features, device="cuda", dtype=torch.bfloat16)
        last = torch.randn(target.config.get_text_config().hidden_size, device="cuda", dtype=torch.bfloat16)
        kernel_table(lambda: proposer.propose(1, context, args.prompt_length, last), args.tokens, args.rows,
                     f"{args.proposer} draft + tree at budget {args.budget} ({args.target_step}, no graphs)")


if __name__ == "__main__":
    main()

"""Where the decode steps of a random-weight hub-spec target spend their GPU time (torch.profiler kernel tables).

    python scripts/profile_ar_step.py --shape qwen3.6-27b --tokens 8 --target-step compiled --proposer weaver

1. The AR step as the AR loop captures it (:class:`~modeling_weaver.decoding.fused.FusedARStep`: the one-token pass with
   its GDN/conv decode kernels, then argmax) run ``--tokens`` times without CUDA graphs (``static``: eager
   fixed-shape ops; ``compiled``: the torch.compile'd pass), so the profiler sees every kernel: GPU busy time per
   step and the kernel table.
2. With ``--graph-gap``: the fused AR step's CUDA graph replayed back to back (GPU time alone), and
   ``autoregressive_generate``'s pipelined loop, ms between the host's token reads: the difference is the host gap.
3. With ``--proposer MODE [MODE ...]``: one DFlash draft + tree build of each mode at ``--budget`` (compiled when
   the target step is), its kernel table.
4. With ``--tree-nodes N``: the verify of an N-node tree (a chain: the GEMMs cost the same for any shape) and the
   commit of a 4-node path, without graphs: what a speculative step's target pass spends beyond the AR step. No
   depth bound is given, so the GDN layers take the row-block verify (the loop's shallow trees take the Neumann
   form at 65 nodes: time that in a replay, ``diagnose_fused_steps.py --ab neumann``).
5. With ``--graphs``: each phase alone as the decoding loop runs it, one CUDA graph replayed back to back (GPU ms per
   replay, median of ``--graph-runs`` timings of ``4 * --tokens`` replays): the fused AR step, the verify of
   ``--tree-nodes`` nodes, and each ``--proposer``'s draft + tree; each as a fraction of the AR step (issue 5's
   "verify ≤ 1.25 AR step", "draft + tree ≤ 15 % of an AR step").
6. With ``--gates-ab``: the AR step's graph timed as in 5 with the GDN gates (g, β) as their own launch and formed
   inside the GDN kernels (:attr:`~modeling_weaver.options.StepOptions.gates_in_kernel`). Each form
   captures through a whole generation (compile + ~1500 tokens): allow ≥ 300 s.
7. With ``--peel-ab`` and ``--tree-nodes N``: the verify graph of an N-node chain timed as in 5 with and without the
   GDN root step (:attr:`~modeling_weaver.options.StepOptions.peel_root`; it applies at N = 16n + 1).
8. With ``--proposer-ab SETTING [...]``: each ``--proposer``'s draft + tree graph timed as in 5 with the switch off
   and on, on steps built anew: ``node_table`` (Weaver node inputs gathered from the precomputed table,
   :attr:`~modeling_weaver.options.StepOptions.node_table`), ``node_attention`` (the Weaver's fused node
   attention, :attr:`~modeling_weaver.options.TreePolicy.fused_node_attention`), ``int8_head`` (the drafter's int8 lm_head
   copy, :attr:`~modeling_weaver.options.StepOptions.int8_head`), ``int8_drafter`` (the drafter's linears on int8
   weights, :func:`~modeling_weaver.packed.int8_linears`).
9. With ``--spine-ab [ROUNDS[,WIDTH] ...]``: the Weaver draft + tree graph timed as in 5 as best-first rounds and
   as spine trees (:attr:`~modeling_weaver.options.TreePolicy.spine`) with each number (and width) of rounds after it.
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from modeling_weaver.lab.benchmark import autoregressive_generate
from modeling_weaver.cli import nonnegative_int, positive_int
from modeling_weaver.decoding.step_cache import cache_bucket, static_draft, static_target
from modeling_weaver.lab.replay import (FirstTokenClock, ab_setting, fresh_steps, graph_replay_ms, random_models,
                                    random_prompt)
from modeling_weaver.options import StepOptions, TreePolicy
from modeling_weaver.tree import Tree


# --proposer-ab: the settings of replay.ab_switches a draft + tree graph reads
PROPOSER_AB = ("node_table", "node_attention", "int8_head", "int8_drafter", "fan64", "root_leaves")


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


def graph_gap(target, ids, target_step: str, ar, reps: int) -> None:
    """The AR loop's time per token against its graph's, in one process: the graph replayed back to back, also with
    the loop's per-step device work (summary copy to pinned memory, event record), from the prompt's end; then
    ``autoregressive_generate`` itself, ms between the host's token reads (mean and median over tokens 16..) in a
    generation that fills ``ar``'s cache bucket (a shorter one could run in a smaller bucket: another step)."""
    step = ar.ar_step()
    graph, summary = step._graph
    host = torch.zeros(1, dtype=torch.long, pin_memory=True)
    event = torch.cuda.Event()

    def copies_and_events(reps: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
            host.copy_(summary, non_blocking=True)
            event.record()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps

    def restart():  # the caches back at the prompt's end, the step seeded
        ar.adapter.reset()
        ar.prefill(ids[0])
        step.seed(int(ids[0, -1]))

    restart()
    back_to_back = graph_replay_ms(graph, reps)[0]
    restart()
    with_copies = copies_and_events(reps)
    tokens = ar.adapter.max_length - ids.shape[1] - 1
    clock = FirstTokenClock(prompt_puts=1)
    autoregressive_generate(target, ids, tokens, eos_token_id=[], target_step=target_step, streamer=clock)
    gaps = sorted(1e3 * (b - a) for a, b in zip(clock.times[16:], clock.times[17:]))
    print(f"\n## AR step, ms per token: graph back to back {back_to_back:.3f}, with the summary copy and event "
          f"{with_copies:.3f}; autoregressive_generate of {tokens} tokens between token reads: mean "
          f"{sum(gaps) / len(gaps):.3f}, median {gaps[len(gaps) // 2]:.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3.6-27b")
    parser.add_argument("--tokens", type=positive_int, default=8)
    parser.add_argument("--prompt-length", type=positive_int, default=512)
    parser.add_argument("--target-step", choices=("static", "compiled"), default="static")
    parser.add_argument("--graph-gap", action="store_true")
    parser.add_argument("--proposer", nargs="+", choices=("chain", "ddtree", "weaver"), default=[])
    parser.add_argument("--budget", type=positive_int, default=64)
    parser.add_argument("--tree-nodes", type=positive_int)
    parser.add_argument("--rows", type=positive_int, default=30)
    parser.add_argument("--graphs", action="store_true", help="each phase alone in a CUDA graph (section 5)")
    parser.add_argument("--gates-ab", action="store_true",
                        help="the AR step's graph with the GDN gates as their own launch and formed in the GDN "
                             "kernel, side by side (section 6)")
    parser.add_argument("--peel-ab", action="store_true",
                        help="the --tree-nodes verify graph with and without the GDN root step (section 7)")
    parser.add_argument("--spine-ab", nargs="*", metavar="ROUNDS[,WIDTH]",
                        help="Weaver draft + tree graph without and with the spine (TreePolicy.spine), at these "
                             "numbers of rounds after it (default TreePolicy.spine_rounds) and widths (default "
                             "TreePolicy.spine_width)")
    parser.add_argument("--proposer-ab", nargs="+", choices=PROPOSER_AB, default=[],
                        help="each --proposer's draft + tree graph with the switch off and on (section 8)")
    parser.add_argument("--graph-runs", type=positive_int, default=7)
    parser.add_argument("--max-length", type=nonnegative_int, default=0,
                        help="cache capacity at least this (the replay's prompt 512 + 512 new tokens: bucket 2048)")
    parser.add_argument("--no-tables", action="store_true",
                        help="skip the AR and verify kernel tables (sections 1 and 4; each compiles its own step)")
    args = parser.parse_args()
    if args.proposer_ab and not args.proposer:
        parser.error("--proposer-ab times draft + tree graphs: pass --proposer MODE")
    if args.peel_ab and not args.tree_nodes:
        parser.error("--peel-ab times the verify of --tree-nodes N nodes (the root step applies at N = 16n + 1)")
    compile = args.target_step == "compiled"
    target, drafter, weaver = random_models(args.shape, torch.device("cuda"), torch.bfloat16)
    ids = random_prompt(target, args.prompt_length)
    # One cache bucket (a power of two) for every call below, so that no timed call allocates, compiles or captures.
    # (the AR graph's timings replay graph_runs * 4 * tokens steps from the prompt's end)
    max_length = cache_bucket(max(args.max_length, args.prompt_length + args.graph_runs * 4 * args.tokens
                                  + max(64, (args.tree_nodes or 0) + 4 * (args.tokens + 1))))
    new_tokens = max_length - args.prompt_length - 1  # autoregressive_generate's capacity: prompt + new + 1

    if not args.no_tables:  # the step the AR loop captures: token_step (one-token GDN/conv kernels) + argmax
        step = static_target(target, max_length, 1, capture=False, compile=compile)
        step.prefill(ids[0])
        ar = step.ar_step()
        ar.seed(int(ids[0, -1]))
        kernel_table(ar._step, args.tokens, args.rows, f"AR step ({args.target_step}, no graphs)")

    n = args.tree_nodes
    chain = Tree.from_lists(ids[0, -n:].tolist(), list(range(-1, n - 1)), device="cuda") if n else None
    if n and not args.no_tables:
        tree_step = static_target(target, max_length, n, capture=False, compile=compile)
        tree_step.prefill(ids[0])

        def verify_step():
            tree_step.verify(chain)
            tree_step.commit([0, 1, 2, 3])

        kernel_table(verify_step, args.tokens, args.rows, f"{n}-node verify + 4-node commit ({args.target_step}, "
                     "no graphs)")

    target_step = "compiled" if compile else "graph"

    def captured_ar(options: StepOptions = StepOptions()):
        """The AR steps' :class:`StaticTarget`, its fused step's CUDA graph (the one-token pass + argmax) captured by
        a generation, after a prefill."""
        autoregressive_generate(target, ids, new_tokens, eos_token_id=[], target_step=target_step,
                                step_options=options)  # captures
        ar = static_target(target, max_length, 1, capture=True, compile=compile, options=options)
        ar.prefill(ids[0])
        return ar

    if args.graph_gap:
        graph_gap(target, ids, target_step, captured_ar(), 4 * args.tokens)

    context = torch.randn(drafter.block_size, drafter.fc.in_features, device="cuda", dtype=torch.bfloat16)
    last = torch.randn(target.config.get_text_config().hidden_size, device="cuda", dtype=torch.bfloat16)
    draft = static_draft(drafter, target, max_length, capture=True)  # graphs only in section 5
    proposers = {mode: draft.proposer(mode, args.budget, weaver if mode == "weaver" else None, compile=compile)
                 for mode in args.proposer}
    for mode, proposer in proposers.items():
        draft.load(1, context, args.prompt_length)
        proposer.last_hidden.copy_(last)
        kernel_table(proposer._forward, args.tokens, args.rows,
                     f"{mode} draft + tree at budget {args.budget} ({args.target_step}, no graphs)")

    def timed(graph) -> float:  # median over runs of the mean GPU ms per replay
        return sorted(graph_replay_ms(graph, 4 * args.tokens)[0] for _ in range(args.graph_runs))[args.graph_runs // 2]

    def verify_graph_ms(options: StepOptions = StepOptions()) -> float:
        tree_graph = static_target(target, max_length, n, capture=True, compile=compile, options=options)
        tree_graph.prefill(ids[0])
        tree_graph.verify(chain)  # captures
        return timed(tree_graph._graphs[0])

    def both_ways(name: str, measure) -> dict:
        """``measure(policy, options)`` with the A/B setting ``name`` (``replay.ab_switches``) off and on
        (``{False: ms, True: ms}``), each on steps built anew."""
        times = {}
        for on in (False, True):
            setting, _ = ab_setting(name, on, drafter, target)
            with setting as (policy, options):
                times[on] = measure(policy, options)
        return times

    if args.gates_ab:
        times = both_ways("gates_in_kernel", lambda policy, options: timed(captured_ar(options).ar_step()._graph[0]))
        print(f"\n## AR step graph, GPU ms per replay: GDN gates as their own launch {times[False]:.3f}, formed in "
              f"the GDN kernel {times[True]:.3f} ({times[True] - times[False]:+.3f})")

    if args.peel_ab:
        times = both_ways("peel_root", lambda policy, options: verify_graph_ms(options))
        print(f"\n## {n}-node verify graph, GPU ms per replay: whole solve {times[False]:.3f}, root as a recurrent "
              f"step {times[True]:.3f} ({times[True] - times[False]:+.3f})")

    if args.graphs:
        phases = [("AR step (one-token pass + argmax)", timed(captured_ar().ar_step()._graph[0]))]
        if n:
            phases.append((f"verify of {n} nodes", verify_graph_ms()))
        for mode, proposer in proposers.items():
            proposer.propose(1, context, args.prompt_length, last)  # captures
            phases.append((f"{mode} draft + tree at budget {args.budget}", timed(draft._graphs[proposer.key][0])))
        print(f"\n## each phase in one CUDA graph ({args.target_step}), GPU ms per replay back to back")
        print("| phase | ms | × AR step |\n|---|---|---|")
        for name, ms in phases:
            print(f"| {name} | {ms:.3f} | {ms / phases[0][1]:.3f} |")

    def weaver_graph_ms(policy: TreePolicy) -> float:
        proposer = draft.proposer("weaver", args.budget, weaver, compile=compile, policy=policy)
        proposer.propose(1, context, args.prompt_length, last)  # captures
        return timed(draft._graphs[proposer.key][0])

    if args.spine_ab is not None:
        with fresh_steps(target):
            line = f"best-first {weaver_graph_ms(TreePolicy(spine=False)):.3f}"
        for item in args.spine_ab or [str(TreePolicy().rounds_on("cuda"))]:
            rounds, _, width = item.partition(",")
            width = int(width) if width else TreePolicy().spine_width
            with fresh_steps(target):
                ms = weaver_graph_ms(TreePolicy(spine=True, spine_rounds=int(rounds), spine_width=width))
                line += f", spine + {rounds} rounds of {width or 'ceil(budget / 8)'} {ms:.3f}"
        print(f"\n## Weaver draft + tree graph at budget {args.budget}, GPU ms per replay: {line} (AR step graph "
              f"{timed(captured_ar().ar_step()._graph[0]):.3f})")

    for name in args.proposer_ab:
        for mode in args.proposer:
            def proposer_graph_ms(policy, options, mode=mode) -> float:  # a drafter built anew for its options
                proposer = static_draft(drafter, target, max_length, capture=True, options=options).proposer(
                    mode, args.budget, weaver if mode == "weaver" else None, compile=compile, policy=policy)
                proposer.propose(1, context, args.prompt_length, last)  # captures
                return timed(proposer.draft._graphs[proposer.key][0])
            times = both_ways(name, proposer_graph_ms)
            print(f"\n## {mode} draft + tree graph at budget {args.budget}, GPU ms per replay: {name} off "
                  f"{times[False]:.3f}, on {times[True]:.3f} ({times[True] - times[False]:+.3f})", flush=True)


if __name__ == "__main__":
    with torch.no_grad():
        main()

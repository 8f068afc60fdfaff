"""Replay suite plus host-side timings of the fused steps and a long-generation memory check, in one process.

    python scripts/diagnose_fused_steps.py --out diag --budget 64 --memory-tokens 4096 \
        [--ab node_table peel_root node_attention neumann spine int8_head int8_drafter]

1. ``run_replay_suite`` (AR and every mode at ``--budget``, ``--target-step``, synthetic traces) → replay.md/json.
2. Per mode: cProfile of one more generation (graphs and compiles in place) sorted by own time, then the fused graph
   alone: how long ``replay()`` takes to return to Python, and its GPU time back to back.
3. ``memory_check``: two ``--memory-tokens`` generations of the first mode (graph steps): growth over the second.
4. ``--auto``: per mode, ``tree_budget="auto"`` after the fixed budget: its choice graph and each captured bucket's
   graph timed alone as in 2, beside the fixed fused graph (where auto's step time goes: the choice, the cut, and the
   host read between them, which is the step time less both graphs' GPU time).
5. ``--timeline``: host timestamps of one AR and one generation per mode at the loop's seams (prefill, the first
   step's draft/verify/commit, every pipelined step's launch and read), no syncs added: where wall time goes that no
   GPU span holds.
"""
import argparse
import cProfile
import gc
import io
import json
import pstats
import time
from pathlib import Path

import torch

from modeling_weaver.lab.benchmark import autoregressive_generate
from modeling_weaver.cli import nonnegative_int, positive_int
from modeling_weaver.decoding.drafting import StaticDraft, StaticProposer
from modeling_weaver.decoding.fused import FusedGreedyStep
from modeling_weaver.decoding.graphs import PipelinedSteps
from modeling_weaver.decoding.step_cache import _STATIC_TARGETS
from modeling_weaver.decoding.verify import StaticTarget
from modeling_weaver.lab.replay import (ReplayedAcceptance, ab_setting, ab_switches, graph_replay_ms, memory_check,
                                    random_models, random_prompt, replay_generate, replay_table, run_replay_suite,
                                    synthetic_trace)


def graph_timing(drafter, mode: str, reps: int = 10) -> str:
    """Host time of ``replay()`` and GPU time back to back (replays advance the caches) of every captured whole step
    of ``mode``: the fused step's graph, and the auto steps' choice and bucket graphs."""
    lines = []
    for key, steps in _STATIC_TARGETS[drafter].items():
        if key[0] != "draft":
            continue
        for step_key, step in steps._steps.items():
            if step_key[0] not in ("fused", "auto") or step.proposer.mode != mode:
                continue
            if step_key[0] == "fused":
                graphs = {"fused graph": step._graph[0]} if step._graph is not None else {}
            else:  # the choice graph, then one per captured bucket
                graphs = {"auto choice (draft, tree, size)" if name == "choose" else
                          f"auto bucket {step.sizes_list[name]}": graph for name, (graph, _, _) in step._graphs.items()}
            for label, graph in graphs.items():
                gpu_ms, host_ms = graph_replay_ms(graph, reps)
                lines.append(f"{mode} {label}: replay() returns after {host_ms:.2f} ms (median), GPU {gpu_ms:.2f} ms "
                             "per replay back to back")
    return "\n".join(lines)


SEAMS = ((StaticTarget, "prefill"), (StaticDraft, "_lead"), (StaticProposer, "propose"), (StaticTarget, "verify"),
         (StaticTarget, "commit"), (FusedGreedyStep, "arm"), (PipelinedSteps, "_launch"), (PipelinedSteps, "_read"))


def host_timeline(fn) -> str:
    """``fn()`` (after one untimed call: captures, compiles) with host timestamps (ms from its start) on entering and
    leaving each seam; a summary."""
    fn()
    torch.cuda.synchronize()
    marks, t0 = [], time.perf_counter()
    originals = [(cls, name, cls.__dict__[name]) for cls, name in SEAMS]

    def stamped(name, method):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                marks.append((name, 1e3 * (start - t0), 1e3 * (time.perf_counter() - t0)))
        return call

    for cls, name, method in originals:
        setattr(cls, name, stamped(name, method))
    gc.collect()
    gc.freeze()
    try:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        total = 1e3 * (time.perf_counter() - t0)
    finally:
        gc.unfreeze()
        for cls, name, method in originals:
            setattr(cls, name, method)
    reads = [end for name, _, end in marks if name == "_read"]
    gaps = [b - a for a, b in zip(reads, reads[1:])]
    lines = [" ".join(f"{n} {a:.1f}-{b:.1f}" for n, a, b in marks if n not in ("_launch", "_read"))]
    if reads:
        gaps_sorted = sorted(gaps) or [0.0]
        lines.append(f"{len(reads)} step reads: first at {reads[0]:.1f} ms, last at {reads[-1]:.1f}; between reads "
                     f"median {gaps_sorted[len(gaps_sorted) // 2]:.2f} ms, min {gaps_sorted[0]:.2f}, max "
                     f"{gaps_sorted[-1]:.2f}, sum {sum(gaps):.1f}; first gaps {[round(g, 2) for g in gaps[:4]]}, "
                     f"last {[round(g, 2) for g in gaps[-4:]]}")
        launches = [(a, b) for n, a, b in marks if n == "_launch"]
        lines.append(f"{len(launches)} launches, host time in them {sum(b - a for a, b in launches):.1f} ms; "
                     f"first launch at {launches[0][0]:.1f} ms")
    lines.append(f"end (synchronised) at {total:.1f} ms")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3.6-27b")
    parser.add_argument("--budget", type=positive_int, default=64)
    parser.add_argument("--modes", nargs="+", default=["weaver", "ddtree", "chain"])
    parser.add_argument("--mal", nargs="+", type=float, default=[7.1, 5.4, 4.0], help="synthetic MAL per mode")
    parser.add_argument("--target-step", default="compiled")
    parser.add_argument("--memory-tokens", type=nonnegative_int, default=0)
    parser.add_argument("--out", default="diag", help="new or empty folder (filled when the run ends or stops)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it holds an earlier output")
    parser.add_argument("--auto", action="store_true", help="auto's graphs beside the fixed step's (step 4)")
    parser.add_argument("--timeline", action="store_true", help="host timeline per method (step 5)")
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile and graph timings (step 2)")
    parser.add_argument("--ab", nargs="+", choices=sorted(ab_switches()), default=[],
                        help="after the suite, the first mode again with each setting flipped (AR again as well)")
    args = parser.parse_args()
    with written_output(args.out, (), args.overwrite, keep_partial=True) as out:
        run(args, out)


def run(args, out: Path):
    device = torch.device("cuda")
    target, drafter, weaver = random_models(args.shape, device, torch.bfloat16)
    traces = {(m, args.budget): synthetic_trace(v, drafter.block_size) for m, v in zip(args.modes, args.mal)}
    torch.cuda.reset_peak_memory_stats(device)

    def save(rows):
        (out / "replay.md").write_text(replay_table(rows) + "\n")
        (out / "replay.json").write_text(json.dumps(rows, indent=1))
        print(replay_table(rows).splitlines()[-1], flush=True)

    rows = run_replay_suite(target, drafter, weaver, traces, args.modes, [args.budget], 512, 512, args.target_step,
                            on_row=save)
    for name in args.ab:
        setting, label = ab_setting(name, None, drafter, target)
        with setting as (policy, options):
            more = run_replay_suite(target, drafter, weaver, traces, args.modes[:1], [args.budget], 512, 512,
                                    args.target_step, tree_policy=policy, step_options=options)
        for row in more:
            row["method"] = f"{row['method']} ({label})"
        save(rows := rows + more)
    print(f"peak {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB", flush=True)
    ids = random_prompt(target, 512)
    if args.timeline:
        print("\n## timeline: ar\n" + host_timeline(lambda: autoregressive_generate(
            target, ids, 512, eos_token_id=[], target_step=args.target_step)), flush=True)
        for mode in args.modes:
            acceptance = ReplayedAcceptance(traces[(mode, args.budget)], device)
            print(f"\n## timeline: {mode}\n" + host_timeline(lambda: replay_generate(
                target, drafter, weaver, ids, mode, args.budget, acceptance, 512, args.target_step)), flush=True)
    for mode in [] if args.no_profile else args.modes:
        acceptance = ReplayedAcceptance(traces[(mode, args.budget)], device)
        replay_generate(target, drafter, weaver, ids, mode, args.budget, acceptance, 512, args.target_step)
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        t0 = time.perf_counter()
        profiler.enable()
        _, stats = replay_generate(target, drafter, weaver, ids, mode, args.budget, acceptance, 512, args.target_step)
        torch.cuda.synchronize()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(22)
        print(f"\n## {mode}: {1e3 * (time.perf_counter() - t0):.0f} ms for {stats.num_steps} steps; phases "
              f"{stats.phase_ms}\n{text.getvalue()}\n{graph_timing(drafter, mode)}", flush=True)
    for mode in args.modes if args.auto else []:
        acceptance = ReplayedAcceptance(traces[(mode, args.budget)], device)
        for _ in range(2):  # (the first captures)
            _, stats = replay_generate(target, drafter, weaver, ids, mode, "auto", acceptance, 512, args.target_step)
        torch.cuda.synchronize()
        print(f"\n## {mode} auto: sizes {dict(stats.size_histogram)}, MAL {stats.mean_accepted_length:.2f}\n"
              f"{graph_timing(drafter, mode)}", flush=True)
    if args.memory_tokens:
        mode = args.modes[0]
        check = memory_check(target, drafter, weaver, traces[(mode, args.budget)], mode, args.budget, 512,
                             args.memory_tokens, "graph")
        (out / "memory.json").write_text(json.dumps(check, indent=1))
        print("memory check (graph steps):", check, flush=True)


if __name__ == "__main__":
    main()

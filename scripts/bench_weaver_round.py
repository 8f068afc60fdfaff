"""Time one Weaver expansion round's two ops at Qwen3.6-27B shape (pool 512, d_model 5120, vocab 248320, budget 64:
fan 8, 4 nodes per round) over their launch configs, each in a CUDA graph of 16 calls (median µs per call).

    PYTHONPATH=$PWD:$PWD/kernels python3 scripts/bench_weaver_round.py
"""
import argparse
import itertools

import torch
from bench_kernels import graph_time_us

from weaver_kernels.weaver_tree import expand, naive


def graph_us(fn, calls: int = 16, reps: int = 30) -> float:
    """Median µs per call of ``fn`` called ``calls`` times in one CUDA graph."""
    return graph_time_us([fn] * calls, reps)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    M, Dm, D, P, V, n, fan = args.nodes, 5120, 15, 512, 248320, 65, 8
    query = torch.randn(M, Dm, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(V, Dm, device="cuda", generator=gen) * 0.02).bfloat16()
    pool_ids = torch.randint(V, (D, P), device="cuda", generator=gen)
    pool_logits = torch.randn(D, P, device="cuda", generator=gen)
    rows = torch.tensor([0, 3, 14, 3] * (M // 4 + 1), device="cuda")[:M]
    print(f"pool scores, {M} nodes x {P} candidates ({M * P * Dm * 2 / 1e6:.1f} MB of lm_head rows):")
    print(f"  torch reference (eager, in a graph): {graph_us(lambda: naive.pool_scores_ref(query, rows, pool_ids, pool_logits, weight)):.1f} µs")  # noqa: E501
    best = None
    for bp, bk, w, st in itertools.product((4, 8, 16), (256, 512), (4, 8), (2, 3)):
        try:
            us = graph_us(lambda: expand.pool_scores_triton(query, rows, pool_ids, pool_logits, weight, BP=bp, BK=bk,
                                                            num_warps=w, num_stages=st))
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
            print(f"  BP={bp} BK={bk} warps={w} stages={st}: {type(e).__name__}")
            continue
        print(f"  BP={bp:2d} BK={bk:3d} warps={w} stages={st}: {us:6.1f} µs")
        if best is None or us < best[0]:
            best = (us, bp, bk, w, st)
    print("  best:", best)
    cand = torch.randn(M, P, device="cuda", generator=gen) * 3
    inf = float("-inf")

    def buffers():
        return dict(tokens=torch.zeros(n, dtype=torch.long, device="cuda"),
                    parents=torch.full((n,), -1, device="cuda"), logq=torch.full((n,), inf, device="cuda"),
                    depth=torch.zeros(n, dtype=torch.long, device="cuda"), score=torch.zeros(n, device="cuda"),
                    mask=torch.eye(n, dtype=torch.bool, device="cuda"), f_score=torch.full((n * fan,), inf, device="cuda"),
                    f_token=torch.zeros(n * fan, dtype=torch.long, device="cuda"),
                    f_logq=torch.zeros(n * fan, device="cuda"))
    b = buffers()
    # a mid-build round: nodes 9..12 expanded, 4 taken (the frontier holds whatever earlier calls left)
    print("expand (nodes 9..12, take 4):")
    print(f"  torch reference: {graph_us(lambda: naive.weaver_expand_ref(cand, pool_ids, *b.values(), 9, 9 + M, 4, D)):.1f} µs")  # noqa: E501
    for w in (1, 2, 4, 8):
        us = graph_us(lambda: expand.weaver_expand_triton(cand, pool_ids, *b.values(), 9, 9 + M, 4, D, num_warps=w))
        print(f"  warps={w}: {us:.1f} µs")


if __name__ == "__main__":
    main()

"""Tree attention over a static KV cache at the Qwen3.6-27B attention shape: masked SDPA vs the split-KV kernel.

    PYTHONPATH=$PWD:$PWD/kernels python scripts/bench_tree_attention.py --nodes 1 65 --bounds 1024 2048

A captured verify step attends over the whole cache bucket (``bound`` rows) while ``length + N`` are in use. Per
shape, 16 layers (each its own cache, so nothing stays in L2 between layers) in one CUDA graph, median µs per layer:
``sdpa`` (what the adapter ran before: ``scaled_dot_product_attention`` with the ``[N, bound]`` bool mask, default
backend), ``sdpa-efficient`` (the same forced onto the memory-efficient backend), the split-KV kernel with its
default plan and with ``--plans``, and its first launch alone (the split partials, without the combine). Also the
relative RMS error of each against an fp64 reference, and the bytes of the rows in use against the copy ceiling.
"""
import argparse
import random

import torch
import torch.nn.functional as F
from bench_kernels import PEAK_BW, graph_time_us
from torch.nn.attention import SDPBackend, sdpa_kernel

from weaver_kernels.testing import ancestor_mask, best_first_parents, rel_rms
from weaver_kernels.tree_attention.naive import tree_attention_mask, tree_attention_ref
from weaver_kernels.tree_attention.split import split_partials, split_plan, tree_attention_triton


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 65])
    parser.add_argument("--bounds", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--used", type=float, default=0.55, help="length + N as a fraction of the bound")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--plans", nargs="*", default=["16,32,64", "64,64,256", "64,32,128", "64,32,512"],
                        help="extra (BM,BN,SPLIT) plans")
    args = parser.parse_args()
    H, HKV, D = args.heads, args.kv_heads, args.head_dim
    dev, dt = torch.device("cuda"), torch.bfloat16
    print("| N | bound | length | variant | µs/layer | rel. RMS vs fp64 | used-row bytes at µs → TB/s |")
    print("|---|---|---|---|---|---|---|")
    for N in args.nodes:
        parents = best_first_parents(N, random.Random(N)) if N > 1 else [-1]
        tm = ancestor_mask(parents, dev)
        for bound in args.bounds:
            length = max(0, int(args.used * bound) - N)
            lt = torch.tensor(length, device=dev)
            layers = []
            for _ in range(args.layers):
                q = torch.randn(1, H, N, D, device=dev, dtype=dt)
                k = torch.randn(1, HKV, bound, D, device=dev, dtype=dt)
                v = torch.randn(1, HKV, bound, D, device=dev, dtype=dt)
                layers.append((q, k, v))
            q0, k0, v0 = layers[0]
            ref = tree_attention_ref(q0.double(), k0.double(), v0.double(), tm, lt, bound, D ** -0.5)
            mask = tree_attention_mask(tm, lt, bound)

            def sdpa(q, k, v):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D ** -0.5,
                                                      enable_gqa=True).transpose(1, 2).reshape(1, N, -1)

            def efficient(q, k, v):
                with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                    return sdpa(q, k, v)

            variants = [("sdpa", sdpa), ("sdpa-efficient", efficient)]
            plans = [None] + [tuple(int(x) for x in p.split(",")) for p in args.plans]
            for plan in plans:
                name = f"split {plan}" if plan else f"split {split_plan(H, HKV, N, bound, D)} (default)"
                variants.append((name, lambda q, k, v, plan=plan: tree_attention_triton(q, k, v, tm, lt, bound,
                                                                                      D ** -0.5, plan=plan)))
            variants.append(("split launch alone, default plan",
                             lambda q, k, v: split_partials(q, k, v, tm, lt, bound, D ** -0.5)))
            used_bytes = 2 * HKV * (length + N) * D * 2 + H * N * D * 2 * 2
            for name, fn in variants:
                try:
                    got = fn(q0, k0, v0)
                    err = rel_rms(got, ref) if not isinstance(got, tuple) else float("nan")  # (partials: no error)
                    us = graph_time_us([lambda fn=fn, t=t: fn(*t) for t in layers], args.reps)
                except Exception as e:  # noqa: BLE001  (a backend that refuses a shape is reported, not fatal)
                    print(f"| {N} | {bound} | {length} | {name} | failed: {repr(e)[:120]} | | |")
                    continue
                print(f"| {N} | {bound} | {length} | {name} | {us:.1f} | {err:.1e} | "
                      f"{used_bytes / 1e6:.2f} MB → {used_bytes / us / 1e6:.2f} (ceiling {PEAK_BW / 1e12:.1f}) |")


if __name__ == "__main__":
    main()

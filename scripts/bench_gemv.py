"""One-row products (the AR step's GEMMs): cuBLAS against a plain Triton GEMV, at Qwen3.6-27B shapes.

    PYTHONPATH=$PWD:$PWD/kernels python scripts/bench_gemv.py

Most of the AR step's GPU time is cuBLAS GEMMs of one row, the 63 MB output projections below the others' bandwidth
(BENCHMARKS.md, the Qwen3.6-27B replay). This times, per weight shape, ``F.linear`` (cuBLAS), ``torch.mv``
(cuBLAS's GEMV path) and a Triton GEMV (each program ``BN`` output columns over all of K, fp32 sums) over a few
tile shapes, each variant one CUDA graph over enough weight copies to be well past the L2 (median µs per product
and TB/s of weight read).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SHAPES = {"out_proj / o_proj": (5120, 6144), "GDN in_proj (merged)": (16432, 5120), "MLP gate/up": (34816, 5120),
          "MLP down": (5120, 17408), "attention q/k/v (merged)": (14336, 5120)}


@triton.jit
def _gemv_kernel(x, w, out, N, K, BN: tl.constexpr, BK: tl.constexpr):
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    col_ok = cols < N
    rows = w + cols.to(tl.int64)[:, None] * K
    acc = tl.full([BN, BK], 0.0, tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        xt = tl.load(x + ks, mask=ks < K, other=0.0).to(tl.float32)
        wt = tl.load(rows + ks[None, :], mask=col_ok[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)
        acc += wt * xt[None, :]
    tl.store(out + cols, tl.sum(acc, axis=1).to(out.dtype.element_ty), mask=col_ok)


def gemv(x, w, out, bn, bk, warps, stages):
    N, K = w.shape
    _gemv_kernel[(triton.cdiv(N, bn),)](x, w, out, N, K, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--bytes", type=float, default=6e9, help="weight bytes per variant's graph")
    args = parser.parse_args()
    from bench_kernels import graph_time_us

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    configs = [(bn, bk, w, s) for bn, bk in ((8, 512), (16, 256), (16, 512), (32, 256), (4, 1024))
               for w, s in ((4, 3), (4, 4), (8, 4))]
    for name, (N, K) in SHAPES.items():
        copies = max(4, int(args.bytes // (2 * N * K)))
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(N, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, ws[0])[0].float()
        mb = 2 * N * K / 1e6
        rate = lambda us: f"{us:.2f} µs ({mb / us:.2f} TB/s)"  # MB per µs = TB/s  # noqa: E731
        line = [f"{name} {N}×{K} ({mb:.0f} MB, {copies} copies): F.linear "
                f"{rate(graph_time_us([lambda w=w: F.linear(x, w) for w in ws], args.reps))}, torch.mv "
                f"{rate(graph_time_us([lambda w=w: torch.mv(w, x[0]) for w in ws], args.reps))}"]
        best = None
        for c in configs:
            err = (gemv(x, ws[0], out, *c).float() - ref).abs().max().item()
            us = graph_time_us([lambda w=w: gemv(x, w, out, *c) for w in ws], args.reps)
            if best is None or us < best[0]:
                best = (us, c, err)
        line.append(f"Triton best {rate(best[0])} at BN, BK, warps, stages = {best[1]} (max |err| {best[2]:.1e})")
        print("; ".join(line), flush=True)
        del ws


if __name__ == "__main__":
    main()

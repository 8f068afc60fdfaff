"""Can the AR step's latency-bound kernels hide part of the next GEMM's weight read? Measured before building it.

    PYTHONPATH=$PWD:$PWD/kernels python scripts/bench_l2_prefetch.py

In a Gated DeltaNet layer's AR step the in_proj GEMM is followed by the conv and delta-rule decode launches
(latency-bound: HBM nearly idle), then the out_proj GEMM (63 MB at Qwen3.6-27B shape). A side stream that pulls the
first P MB of out_proj's weight into L2 while conv and decode run would let the GEMM read those bytes from L2. This
script times 48 such layers (random bf16 weights at the real shape, one CUDA graph, weights well past the L2) without
and with that prefetch, for several P and two ways of prefetching: ``load`` (loads kept in L2 with evict_last) and
``hint`` (PTX ``prefetch.global.L2::evict_last``, no registers). It also times each piece alone, and the out_proj GEMM
right after a serial prefetch (what an L2 hit is worth). Prints µs per layer; the difference from ``none`` is what a
prefetch would take off each GDN layer's step.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _prefetch_load_kernel(w, n, sink, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(w + offs, mask=offs < n, other=0, eviction_policy="evict_last")
    m = tl.max(x, axis=0)
    if m == -7:  # a store the compiler cannot drop, almost never taken (it writes only the sink)
        tl.store(sink, m)


@triton.jit
def _prefetch_hint_kernel(w, n, BLOCK: tl.constexpr):
    # one 128-byte line per lane (w is int32: 32 elements a line)
    offs = (tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)) * 32
    ptrs = w + tl.minimum(offs, n - 1)
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


def prefetch(weight: torch.Tensor, nbytes: int, how: str, sink: torch.Tensor):
    w = weight.view(-1).view(torch.int32)
    n = min(nbytes // 4, w.numel())
    if how == "load":
        _prefetch_load_kernel[(triton.cdiv(n, 4096),)](w, n, sink, BLOCK=4096, num_warps=8)
    else:
        _prefetch_hint_kernel[(triton.cdiv(n, 32 * 256),)](w, n, BLOCK=256, num_warps=8)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--mb", type=int, nargs="+", default=[8, 16, 24, 32, 48])
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    from bench_kernels import graph_time_us

    import weaver_kernels as wk

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    dev, bf = "cuda", torch.bfloat16
    H, HK, HV, D, CK = 5120, 16, 48, 128, 4
    conv_dim = 2 * HK * D + HV * D
    L = args.layers
    gen = torch.Generator(dev).manual_seed(0)

    def rnd(*shape, s=0.02, dtype=bf):
        return (torch.randn(*shape, generator=gen, device=dev) * s).to(dtype)

    w_in = [rnd(conv_dim + HV * D + 2 * HV, H) for _ in range(L)]
    w_out = [rnd(H, HV * D) for _ in range(L)]
    conv_w, A_log, dt_bias, norm_w = rnd(conv_dim, CK, s=0.5), rnd(HV, s=1.0).float(), rnd(HV).float(), rnd(D) + 1
    window = [rnd(1, conv_dim, CK - 1) for _ in range(L)]
    state = [torch.zeros(1, HV, D, D, device=dev) for _ in range(L)]
    x = rnd(1, 1, H, s=1.0)
    sink = torch.zeros(1, device=dev, dtype=torch.int32)
    side = torch.cuda.Stream()
    o1 = rnd(1, 1, HV * D, s=1.0)

    def gdn_rest(i, proj):
        """conv + delta-rule decode of the in_proj output → o [1, 1, HV·D]"""
        mixed, z, b, a = proj.split([conv_dim, HV * D, HV, HV], dim=-1)
        conv = wk.conv_decode(mixed, window[i], conv_w, None, activation="silu")
        q, k, v = conv.split([HK * D, HK * D, HV * D], dim=-1)
        o = wk.gdn_decode(q.reshape(1, 1, HK, D), k.reshape(1, 1, HK, D), v.reshape(1, 1, HV, D), a, b, state[i],
                          norm_weight=norm_w, gate=z.reshape(1, 1, HV, D), use_qk_l2norm_in_kernel=True,
                          A_log=A_log, dt_bias=dt_bias)
        return o.reshape(1, 1, -1)

    def layer(i, mb=0, how="load"):
        proj = F.linear(x, w_in[i])
        if mb:  # fork after in_proj: the prefetch overlaps conv + decode; joined before out_proj
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                prefetch(w_out[i], mb << 20, how, sink)
        o = gdn_rest(i, proj)
        if mb:
            torch.cuda.current_stream().wait_stream(side)
        return F.linear(o, w_out[i])

    t = lambda fns: graph_time_us(fns, args.reps)  # noqa: E731
    print(f"{L} GDN layers at Qwen3.6-27B shape, µs per layer (median of {args.reps} graph replays)")
    base = t([lambda i=i: layer(i) for i in range(L)])
    print(f"  none: {base:.2f}")
    print(f"  pieces: in_proj {t([lambda i=i: F.linear(x, w_in[i]) for i in range(L)]):.2f}, "
          f"in_proj + conv + decode {t([lambda i=i: gdn_rest(i, F.linear(x, w_in[i])) for i in range(L)]):.2f}, "
          f"out_proj {t([lambda i=i: F.linear(o1, w_out[i]) for i in range(L)]):.2f}")
    for how in ("load", "hint"):
        for mb in args.mb:
            alone = t([lambda i=i: prefetch(w_out[i], mb << 20, how, sink) for i in range(L)])
            serial = t([lambda i=i: (prefetch(w_out[i], mb << 20, how, sink), F.linear(o1, w_out[i])) for i in range(L)])
            over = t([lambda i=i: layer(i, mb, how) for i in range(L)])
            print(f"  {how} {mb:3d} MB: layer {over:.2f} ({over - base:+.2f}); prefetch alone {alone:.2f}, "
                  f"prefetch then out_proj {serial:.2f}")


if __name__ == "__main__":
    main()

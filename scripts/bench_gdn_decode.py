"""Time the one-token GDN kernel (the AR step's form: raw gates, q/k l2-norm and the gated RMSNorm in the launch) at
Qwen3.6-27B shape over its launch configs: 48 layers (one state each) in one CUDA graph, median µs per layer.

    PYTHONPATH=$PWD:$PWD/kernels python3 scripts/bench_gdn_decode.py

Each config's output and state are checked against the one-program-per-head form (BV = V) on the same inputs.
Bytes: the fp32 state read and written once (2 · HV · K · V · 4) plus the token's inputs.
"""
import argparse

import torch
from bench_kernels import graph_time_us

from weaver_kernels.gdn_tree import fused_recurrent
from weaver_kernels.testing import gdn_inputs, rel_rms


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--configs", nargs="+", default=["128:4", "128:8", "128:16", "64:4", "64:8", "32:4", "32:2",
                                                          "16:2", "16:4"], help="BV:warps")
    args = parser.parse_args()
    H, HV, K, V, dev = 16, 48, 128, 128, "cuda"
    layers = []
    for i in range(args.layers):
        q, k, v, g, beta, S = gdn_inputs(1, 1, H, HV, K, V, torch.bfloat16, dev, seed=i)
        gen = torch.Generator().manual_seed(1000 + i)
        a = (torch.randn(1, 1, HV, generator=gen) * 3).to(dev, torch.bfloat16)
        b = torch.randn(1, 1, HV, generator=gen).to(dev, torch.bfloat16)
        A_log, dt_bias = torch.randn(HV, generator=gen).to(dev), torch.randn(HV, generator=gen).to(dev)
        weight = torch.randn(V, generator=gen).to(dev, torch.bfloat16)
        gate = torch.randn(1, 1, HV, V, generator=gen).to(dev, torch.bfloat16)
        layers.append(dict(q=q, k=k, v=v, a=a, b=b, S=S.float(), A_log=A_log, dt_bias=dt_bias, w=weight, z=gate,
                           out=torch.empty(1, 1, HV, V, device=dev, dtype=torch.bfloat16)))
    mb = 2 * HV * K * V * 4 / 1e6

    def call(L, state, BV, warps, norm=True):
        return fused_recurrent.gdn_decode_triton(
            L["q"], L["k"], L["v"], L["a"], L["b"], state, L["w"] if norm else None, L["z"] if norm else None,
            None, 1e-6, True, L["A_log"], L["dt_bias"], BV=BV, num_warps=warps, out=L["out"])

    ref, first = [], [L["S"].clone() for L in layers[:4]]  # (the timings advance every layer's state in place)
    for L, S0 in zip(layers[:4], first):
        state = S0.clone()
        ref.append((call(L, state, V, 8).clone(), state))
    print(f"GDN decode, H={H} HV={HV} K={K} V={V}, raw gates + l2norm, {args.layers} layers per graph; state "
          f"{mb:.2f} MB read+write per layer")
    rows = []
    for norm in (True, False):
        for cfg in args.configs if norm else ["32:4", "16:4"]:
            BV, warps = map(int, cfg.split(":"))
            errs = []
            for L, S0, (o_ref, s_ref) in zip(layers[:4], first, ref):
                state = S0.clone()
                o = call(L, state, BV, warps, norm).clone()
                errs.append(max(rel_rms(o, o_ref) if norm else 0.0, rel_rms(state, s_ref)))
            us = graph_time_us([lambda L=L: call(L, L["S"], BV, warps, norm) for L in layers], args.reps)
            label = f"{'gated norm' if norm else 'no norm   '} BV={BV:3d} warps={warps:2d}"
            rows.append((us, label))
            print(f"  {label}: {us:6.2f} µs per layer  ({mb / us:.2f} TB/s on the state; vs BV=V form "
                  f"{max(errs):.1e})", flush=True)
    print("fastest with the norm:", min(r for r in rows if r[1].startswith("gated")))


if __name__ == "__main__":
    main()

"""Benchmark the tree kernels at Qwen3.6-27B's GDN shape (H=16, HV=48, K=V=128, batch 1) on one GPU.

For T ∈ {16, 32, 64, 128} nodes, on random best-first trees (depth ≤ 15, docs/DESIGN.md §4) and chains, in one run:

- ours: ``gdn_tree_verify`` (Triton, rollback-free) and ``gdn_tree_commit`` (accepted path = deepest leaf; for chains
  the whole chain), separately and as one verify+commit step;
- (a) mainline baseline: recurrent kernel over the flattened tree writing every node's state + copy of the accepted
  one (``weaver_kernels.gdn_tree.baseline``), its best block size;
- (b) fla ``fused_recurrent_gated_delta_rule`` / ``chunk_gated_delta_rule`` on a chain of the same length (output +
  final state; if fla is importable);
- (c) the torch reference (verify + commit, fp32, eager);
- the tree conv1d + window commit at C = 10240.

Timing (docs/DESIGN.md §9): inputs for ``--layers`` distinct layers (rotated, so states are not in L2), one CUDA graph
per measurement replaying all layers; per-layer µs = replay time / layers; median of ``--reps`` replays after
warm-up (autotuning happens before capture). Eager per-call medians (host launch included) are reported beside
them. Bytes are the minimum traffic (each input read once, each output written once) over the measured time,
against the ≈4.3 TB/s copy bandwidth measured on these H200s.

    python scripts/bench_kernels.py [--T 16 32 64 128] [--layers 24] [--reps 60] [--impls fused resident neumann]
        [--no-fla] [--no-ref] [--no-baseline] [--commit-chunks 32 64] [--verify-bt 32 64]
        [--commit-precision tf32x3] [--verify-inverse-precision tf32x3] [--resident-configs 64:8]
        [--out bench.json]

(``PYTHONPATH=kernels`` where the package is not installed, e.g. on the lent GPU machine; fla is optional.)
Results with their commands: BENCHMARKS.md, "Kernels" (current); every recorded run: docs/history/benchmarks-log.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import traceback

import torch

from weaver_kernels.conv_tree.conv import conv_tree_commit_triton, conv_tree_triton
from weaver_kernels.gdn_tree.baseline import recurrent_tree_verify
from weaver_kernels.gdn_tree.chunk import (
    NEUMANN_MAX_NODES,
    RESIDENT_MAX_NODES,
    gdn_tree_commit_triton,
    gdn_tree_verify_triton,
)
from weaver_kernels.gdn_tree.naive import gdn_tree_commit_ref, gdn_tree_verify_ref
from weaver_kernels.testing import (
    ancestor_mask,
    gdn_inputs,
    path_to,
    rel_rms,
    tree_of_kind,
)

H, HV, K, V = 16, 48, 128, 128
C_CONV = 2 * H * K + HV * V
PEAK_BW = 4.3e12


def graph_time_us(fns, reps, warm=3):
    """Median per-call µs of ``fns`` (one per layer) replayed as one CUDA graph."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    for _ in range(warm):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / len(fns))
    del g
    return statistics.median(times)


def eager_time_us(fns, reps, warm=3):
    """Median µs of single eager calls (host launch overhead included when it exceeds the device time)."""
    for _ in range(warm):
        for f in fns:
            f()
    torch.cuda.synchronize()
    times = []
    for r in range(reps):
        f = fns[r % len(fns)]
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        f()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3)
    return statistics.median(times)


def timed(name, fns, reps, graph=True):
    out = {}
    try:
        out["eager_us"] = eager_time_us(fns, reps)
    except Exception as e:  # noqa: BLE001
        out["eager_error"] = repr(e)[:300]
    if graph:
        try:
            out["graph_us"] = graph_time_us(fns, reps)
        except Exception as e:  # noqa: BLE001
            out["graph_error"] = repr(e)[:300]
            torch.cuda.synchronize()
    out["us"] = out.get("graph_us", out.get("eager_us"))
    return out


def make_layers(T, kind, n_layers, seed):
    parents, dep, leaf = tree_of_kind(T, kind, random.Random(seed))
    path = torch.tensor(path_to(parents, leaf), device="cuda")
    mask = ancestor_mask(parents, "cuda")
    par_t = torch.tensor(parents, device="cuda")
    layers = []
    for layer in range(n_layers):
        q, k, v, g, beta, S0 = gdn_inputs(1, T, H, HV, K, V, torch.bfloat16, "cuda", seed * 1000 + layer, True)
        layers.append(dict(q=q, k=k, v=v, g=g, beta=beta, S0=S0, S=S0.clone()))
    return parents, dep, mask, par_t, path, layers


def bytes_verify(T):
    return (2 * T * H * K * 2 + T * HV * V * 2 + 2 * T * HV * 4 + HV * K * V * 4 + T * T  # inputs
            + T * HV * V * 2 + T * HV * V * 4 + T * HV * 4)  # o, u, gamma


def bytes_commit(L):
    return 2 * HV * K * V * 4 + L * (H * K * 2 + HV * V * 4 + HV * 4) + L * 8


def bytes_baseline(T):
    return (2 * T * H * K * 2 + T * HV * V * 2 + 2 * T * HV * 4 + HV * K * V * 4 + T * HV * V * 2
            + T * HV * K * V * 4  # every intermediate state written
            + 2 * HV * K * V * 4)  # accepted copy


def _variant_kw(impl: str, config: str) -> dict:
    """impl and 'BV:num_warps[:inverse_precision]' → gdn_tree_verify_triton keywords."""
    f = config.split(":")
    kw = dict(impl=impl) if f[0] == "0" else dict(impl=impl, BV=int(f[0]), num_warps=int(f[1]))
    if len(f) > 2:
        kw["inverse_precision"] = f[2]
    return kw


def bench_T(T, kind, args, fla):
    parents, dep, mask, par_t, path, layers = make_layers(T, kind, args.layers, seed=T + (7 if kind == "chain" else 0))
    L = path.numel()
    res = dict(T=T, kind=kind, max_depth=max(dep), path_len=L)
    # accuracy spot check on layer 0 (fp64 reference)
    x = layers[0]
    o, u, gm = gdn_tree_verify_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], x["S0"], mask,
                                      use_qk_l2norm_in_kernel=True)
    d = lambda t: t.double()  # noqa: E731
    ro, ru, rg = gdn_tree_verify_ref(d(x["q"]), d(x["k"]), d(x["v"]), d(x["g"]), d(x["beta"]), d(x["S0"]), mask,
                                     use_qk_l2norm_in_kernel=True)
    S = x["S0"].clone()
    gdn_tree_commit_triton(S, x["k"], u, gm, path, use_qk_l2norm_in_kernel=True)
    Sr = d(x["S0"]).clone()
    gdn_tree_commit_ref(Sr, d(x["k"]), ru, rg, path, use_qk_l2norm_in_kernel=True)
    res["rel_rms"] = dict(o=rel_rms(o, ro), u=rel_rms(u, ru), gamma=rel_rms(gm, rg), state=rel_rms(S, Sr))
    u0, gm0 = u, gm  # layer 0's verify outputs, for the commit variants' accuracy

    # ours: static outputs per layer so the graph holds no allocations from the timed region
    outs = [dict(o=torch.empty_like(x["v"]), u=torch.empty(x["v"].shape, device="cuda"),
                 gamma=torch.empty(1, T, HV, device="cuda")) for x in layers]

    def verify_fn(x, ob, impl):
        return lambda: gdn_tree_verify_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], x["S0"], mask,
                                              use_qk_l2norm_in_kernel=True, o=ob["o"], u=ob["u"], gamma=ob["gamma"],
                                              impl=impl)

    def commit_fn(x, ob, **kw):
        return lambda: gdn_tree_commit_triton(x["S"], x["k"], ob["u"], ob["gamma"], path, use_qk_l2norm_in_kernel=True,
                                              **kw)

    def step_fn(x, ob, impl):
        v_, c_ = verify_fn(x, ob, impl), commit_fn(x, ob)
        return lambda: (v_(), c_())

    limits = {"resident": RESIDENT_MAX_NODES, "neumann": NEUMANN_MAX_NODES}
    impls = [i for i in args.impls if T <= limits.get(i, T)]
    for impl in impls:
        o, u, gm = gdn_tree_verify_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], x["S0"], mask,
                                          use_qk_l2norm_in_kernel=True, impl=impl)
        res[f"rel_rms_{impl}"] = dict(o=rel_rms(o, ro), u=rel_rms(u, ru), gamma=rel_rms(gm, rg))
        res[f"verify_{impl}"] = timed("verify", [verify_fn(x, ob, impl) for x, ob in zip(layers, outs)], args.reps)
        res[f"step_{impl}"] = timed("verify+commit", [step_fn(x, ob, impl) for x, ob in zip(layers, outs)], args.reps)
    res["verify"] = min((res[f"verify_{i}"] for i in impls), key=lambda r: r["us"])
    res["step"] = min((res[f"step_{i}"] for i in impls), key=lambda r: r["us"])
    res["commit"] = timed("commit", [commit_fn(x, ob) for x, ob in zip(layers, outs)], args.reps)
    commits = [(f"chunk{c}", dict(chunk=c)) for c in args.commit_chunks]
    commits += [(f"prec_{p}", dict(precision=p)) for p in args.commit_precision]
    commits += [(f"cfg{c}", dict(zip(("BV", "num_warps", "split_k"), map(int, c.split(":")))))
                for c in args.commit_configs]
    for name, kw in commits:  # side by side with the default commit
        res[f"commit_{name}"] = timed(f"commit {name}", [commit_fn(x, ob, **kw) for x, ob in zip(layers, outs)],
                                      args.reps)
        S = x["S0"].clone()
        gdn_tree_commit_triton(S, x["k"], u0, gm0, path, use_qk_l2norm_in_kernel=True, **kw)
        res[f"commit_{name}"]["rel_rms_state"] = rel_rms(S, Sr)
    variants = [(f"bt{bt}", dict(BT=bt)) for bt in args.verify_bt]
    variants += [(f"inv_{p}", dict(inverse_precision=p)) for p in args.verify_inverse_precision]
    variants += [(f"res{c}", _variant_kw("resident", c)) for c in args.resident_configs]
    neumann_peel = args.verify_peel and T - 1 in (16, 32, 64, 128)  # the root step halves T_pad there
    if T - neumann_peel <= NEUMANN_MAX_NODES:
        variants += [(f"neu{c}", dict(_variant_kw("neumann", c), peel_root=neumann_peel)) for c in args.neumann_configs]
    variants += [("peel", dict(peel_root=True))] if args.verify_peel and T % 16 == 1 else []  # where it applies
    for name, kw in variants:  # side by side with the default fused verify
        kw = dict(kw)
        impl = kw.pop("impl", "fused")
        fns = [lambda x=x, ob=ob, kw=kw, impl=impl: gdn_tree_verify_triton(
            x["q"], x["k"], x["v"], x["g"], x["beta"], x["S0"], mask, use_qk_l2norm_in_kernel=True, o=ob["o"],
            u=ob["u"], gamma=ob["gamma"], impl=impl, **kw) for x, ob in zip(layers, outs)]
        try:
            o, u, gm = gdn_tree_verify_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], x["S0"], mask,
                                              use_qk_l2norm_in_kernel=True, impl=impl, **kw)
        except Exception as e:  # noqa: BLE001  (a config that does not fit: report it, time the others)
            print(f"variant {name} at T={T} failed: {repr(e)[:200]}")
            res[f"verify_{name}"] = dict(us=float("nan"), rel_rms=dict(o=float("nan"), state=float("nan")))
            continue
        S = x["S0"].clone()
        gdn_tree_commit_triton(S, x["k"], u, gm, path, use_qk_l2norm_in_kernel=True)
        res[f"verify_{name}"] = dict(timed(f"verify {name}", fns, args.reps), rel_rms=dict(
            o=rel_rms(o, ro), u=rel_rms(u, ru), gamma=rel_rms(gm, rg), state=rel_rms(S, Sr)))
    res["autotuned"] = _best_configs()

    if args.no_baseline:
        res["baseline"] = None
        return _finish(res, T, L, args, par_t, path)
    # (a) baseline: recurrent over the flattened tree + accepted copy; best block size
    inter = torch.empty(1, T, HV, K, V, device="cuda")
    leaf = int(path[-1])
    best = None
    for bv in (16, 32):
        def base_fn(x, bv=bv):
            def f():
                recurrent_tree_verify(x["q"], x["k"], x["v"], x["g"], x["beta"], x["S0"], par_t,
                                      use_qk_l2norm_in_kernel=True, intermediate=inter, BV=bv)
                x["S"].copy_(inter[:, leaf])
            return f
        try:
            r = timed("baseline", [base_fn(x) for x in layers], args.reps)
            r["BV"] = bv
            if best is None or r["us"] < best["us"]:
                best = r
        except Exception as e:  # noqa: BLE001
            res.setdefault("baseline_errors", []).append(repr(e)[:300])
    if best is not None:
        ob, _ = recurrent_tree_verify(x["q"], x["k"], x["v"], x["g"], x["beta"], x["S0"], par_t,
                                      use_qk_l2norm_in_kernel=True, BV=best["BV"])
        best["rel_rms_o"] = rel_rms(ob, ro)
    res["baseline"] = best

    # (b) fla on a chain of the same length
    if fla is not None:
        for name in ("fused_recurrent_gated_delta_rule", "chunk_gated_delta_rule"):
            fn = getattr(fla, name)

            def fla_fn(x, fn=fn):
                return lambda: fn(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=x["S0"],
                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
            try:
                res["fla_" + name.split("_gated")[0]] = timed(name, [fla_fn(x) for x in layers], args.reps)
            except Exception as e:  # noqa: BLE001
                res["fla_" + name.split("_gated")[0]] = {"error": repr(e)[:300]}

    return _finish(res, T, L, args, par_t, path, mask, layers)


def _best_configs():
    from weaver_kernels.gdn_tree import fused

    at = fused._gdn_tree_verify_autotuned
    return {"_gdn_tree_verify_autotuned": {str(k): str(v) for k, v in getattr(at, "cache", {}).items()}}


def _finish(res, T, L, args, par_t, path, mask=None, layers=None):
    # (c) torch reference (fp32 math, eager; its commit filters the path on the host)
    def ref_fn(x):
        def f():
            o_, u_, g_ = gdn_tree_verify_ref(x["q"], x["k"], x["v"], x["g"], x["beta"], x["S0"], mask,
                                             use_qk_l2norm_in_kernel=True)
            gdn_tree_commit_ref(x["S"], x["k"], u_, g_, path, use_qk_l2norm_in_kernel=True)
        return f
    if not args.no_ref and layers is not None:
        res["torch_ref"] = timed("ref", [ref_fn(x) for x in layers[:4]], max(10, args.reps // 4), graph=False)

    # tree conv + window commit at C = 10240
    gen = torch.Generator().manual_seed(T)
    convs = []
    for _ in range(args.layers):
        xc = torch.randn(1, T, C_CONV, generator=gen).to("cuda", torch.bfloat16)
        st = torch.randn(1, C_CONV, 4, generator=gen).to("cuda", torch.bfloat16)
        convs.append((xc, st, torch.empty_like(xc)))
    wgt = (torch.randn(C_CONV, 4, generator=gen) * 0.5).to("cuda", torch.bfloat16)

    def conv_fn(c):
        xc, st, oc = c
        return lambda: (conv_tree_triton(xc, st[..., 1:], wgt, None, par_t, "silu", out=oc),
                        conv_tree_commit_triton(st[..., 1:], xc, path))
    res["conv"] = timed("conv", [conv_fn(c) for c in convs], args.reps)

    # bytes
    res["bytes"] = dict(verify=bytes_verify(T), commit=bytes_commit(L), baseline=bytes_baseline(T),
                        conv=2 * T * C_CONV * 2 + C_CONV * 4 * 2 * 2 + L * C_CONV * 2)
    return res


def fmt_row(r, impls):
    nan = float("nan")
    v, c, s = r["verify"]["us"], r["commit"]["us"], r["step"]["us"]
    per_impl = " | ".join(f"{r.get(f'verify_{i}', {}).get('us', nan):7.1f}" for i in impls)
    b = r.get("baseline") or {}
    bus = b.get("us", float("nan"))
    fr = r.get("fla_fused_recurrent", {}).get("us", float("nan"))
    fc = r.get("fla_chunk", {}).get("us", float("nan"))
    ref = r.get("torch_ref", {}).get("us", nan)
    by = r["bytes"]
    bw = by["verify"] / (v * 1e-6) / 1e12
    bwb = by["baseline"] / (bus * 1e-6) / 1e12 if bus == bus else float("nan")
    return (f"| {r['kind']:10s} | {r['T']:3d} | {r['max_depth']:2d} | {r['path_len']:3d} | {per_impl} | {c:6.1f} | {s:7.1f} "
            f"| {bus:7.1f} (BV{b.get('BV', '-')}) | {bus / s:5.1f}x | {fr:7.1f} | {fc:7.1f} | {ref:8.0f} "
            f"| {r['conv']['us']:6.1f} | {by['verify'] / 1e6:5.2f} MB {bw:4.2f} TB/s | {by['baseline'] / 1e6:6.1f} MB "
            f"{bwb:4.2f} TB/s |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--kinds", nargs="+", default=["best_first", "chain"])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--out", default=None, help="JSON file to write (a new file: an existing one is refused)")
    ap.add_argument("--impls", nargs="+", default=["fused", "resident"])
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--no-ref", action="store_true")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--commit-chunks", type=int, nargs="*", default=[],
                    help="also time the commit with this many path entries per loop step (e.g. 32 64)")
    ap.add_argument("--commit-precision", nargs="*", default=[], choices=("tf32x3", "tf32"),
                    help="also time the commit with its path product at this dot precision")
    ap.add_argument("--commit-configs", nargs="*", default=[],
                    help="also time the commit at these BV:num_warps:split_k configs (default 16:4:1), e.g. 32:4:1 "
                         "16:4:2")
    ap.add_argument("--verify-inverse-precision", nargs="*", default=[], choices=("tf32x3", "tf32"),
                    help="also time the fused verify with its diagonal inverse and solve at this dot precision")
    ap.add_argument("--verify-bt", type=int, nargs="*", default=[],
                    help="also time the fused verify with this many rows per serial block (e.g. 32 64)")
    ap.add_argument("--resident-configs", nargs="*", default=[],
                    help="also time the resident verify at these BV:num_warps[:inverse_precision] configs, "
                         "e.g. 32:4 64:8 32:4:tf32x3")
    ap.add_argument("--neumann-configs", nargs="*", default=[],
                    help="also time the Neumann verify (impl='neumann', T ≤ 128, or 129 with --verify-peel) at these "
                         "BV:num_warps[:inverse_precision] configs (the default config: 0:0), side by side with the "
                         "fused one; with --verify-peel, at T = 2^n + 1 with the root step")
    ap.add_argument("--verify-peel", action="store_true",
                    help="also time the fused verify with peel_root (node 0 as a recurrent step), at the --T of the "
                         "form 16n + 1 (e.g. --T 17 65 129)")
    args = ap.parse_args()
    if args.out and os.path.lexists(args.out):  # refused before minutes of timing, not after
        ap.error(f"argument --out: {args.out} already exists; choose another file")
    fla = None
    if not args.no_fla:
        try:
            import fla.ops.gated_delta_rule as fla  # noqa: F811
        except Exception as e:  # noqa: BLE001
            print("fla not available:", repr(e)[:200])
    import triton

    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                fla=getattr(sys.modules.get("fla"), "__version__", None), python=platform.python_version(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=" ".join(sys.argv), layers=args.layers, reps=args.reps)
    print(json.dumps(meta))
    results = []
    for kind in args.kinds:
        for T in args.T:
            try:
                r = bench_T(T, kind, args, fla)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
                continue
            results.append(r)
            print(json.dumps(r), flush=True)
    print("\nper layer, µs (CUDA-graph replay of", args.layers, "layers, median of", args.reps, "replays)")
    print("| tree | T | depth | path | " + " | ".join(f"verify {i}" for i in args.impls) + " | commit "
          "| verify+commit (best) | baseline (a) | speedup | fla fused_rec (chain) | fla chunk (chain) | torch ref "
          "| conv+commit | verify bytes | baseline bytes |")
    print("|---" * (14 + len(args.impls)) + "|")
    for r in results:
        print(fmt_row(r, args.impls))
    if (args.commit_chunks or args.verify_bt or args.commit_precision or args.verify_inverse_precision
            or args.commit_configs or args.resident_configs or args.neumann_configs or args.verify_peel):
        print("\nvariants side by side (per layer, µs; default: verify BT=16, commit chunk=32):")
        for r in results:
            print(r["kind"], r["T"], f"verify fused {r.get('verify_fused', {}).get('us', float('nan')):.1f}",
                  " ".join(f"{n} {r[f'verify_{n}']['us']:.1f} (o {r[f'verify_{n}']['rel_rms']['o']:.1e}, "
                           f"state {r[f'verify_{n}']['rel_rms']['state']:.1e})"
                           for n in [f"bt{b}" for b in args.verify_bt]
                           + [f"inv_{p}" for p in args.verify_inverse_precision]
                           + [f"res{c}" for c in args.resident_configs]
                           + [f"neu{c}" for c in args.neumann_configs if f"verify_neu{c}" in r]
                           + ["peel"] * (args.verify_peel and r["T"] % 16 == 1)),
                  f"| commit {r['commit']['us']:.1f}",
                  " ".join(f"{n} {r[f'commit_{n}']['us']:.1f} (state {r[f'commit_{n}']['rel_rms_state']:.1e})"
                           for n in [f"chunk{c}" for c in args.commit_chunks]
                           + [f"prec_{p}" for p in args.commit_precision]
                           + [f"cfg{c}" for c in args.commit_configs]))
    print("\naccuracy (layer 0 vs fp64 reference, rel. RMS):")
    for r in results:
        print(r["kind"], r["T"], {k: f"{e:.2e}" for k, e in r["rel_rms"].items()},
              {i: r.get(f"rel_rms_{i}", {}).get("o") for i in args.impls},
              "baseline o", f"{(r.get('baseline') or {}).get('rel_rms_o', float('nan')):.2e}")
    if args.out:
        with open(args.out, "x") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)


if __name__ == "__main__":
    main()

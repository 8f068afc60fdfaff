"""Benchmark the tree KDA verify + commit at Kimi-Linear-48B-A3B's KDA layer shape (issue #31's kernel table).

Kimi Linear's KDA layers have 32 heads of 128 (q/k heads = value heads, K = V = 128; batch 1). For T ∈ {64, 65, 128,
129} tree nodes (a budget of 64 or 128 drafts, with or without the root), on random best-first trees and depth-15
spines with side branches (``weaver_kernels.testing``, as ``scripts/bench_kernels.py``), side by side in one process:

- KDA tree: ``kda_tree_verify_triton`` (``kda_tree.fused``, rollback-free, writes no state) and
  ``kda_tree_commit_triton`` (``kda_tree.commit``, accepted path = deepest leaf), separately and as one step; the
  strip form ``kda_tree_verify_strip`` (``kda_tree.strip``, T ≤ 64) with the same commit, what the
  ``weaver_kernels.kda_tree_verify`` / ``kda_tree_commit`` ops launch on CUDA up to 64 nodes (the fused form
  above), at its defaults and at every ``--strip`` config; the bar columns take the ops' form; beside
  them the verify's Neumann form ``kda_tree_verify_neumann`` (``kda_tree.neumann``, T ≤ 128) with the same commit,
  its solve's dots in tf32x3 (its default: tensor cores, three passes) and in IEEE fp32 (FMA dots), and with 32 key
  channels per chunk instead of 16 (half the chunks, so half the CTA barriers of the coefficient and solve loops);
- GDN tree at the same heads and dims: ``gdn_tree_verify_triton`` in its default form (``impl=None``) and
  ``gdn_tree_commit_triton``, what ``bench_kernels.py`` times (plus the fused form where the default is another);
- the intermediate-state baseline for KDA: a recurrent Triton kernel (defined here: the package has no KDA one) that
  walks the flattened tree node by node, starting each node from its parent's state and writing every node's full
  ``[K, V]`` fp32 state, then a torch copy of the accepted leaf's state into the committed one — the mainline approach
  (``weaver_kernels.gdn_tree.baseline`` for GDN) with KDA's per-channel decay; its best value block;
- fla's ``chunk_kda`` and ``fused_recurrent_kda`` (``fla.ops.kda``) on a chain of T tokens (output + final state),
  when fla is importable.

Inputs are what the model feeds the ops (``modeling_weaver.target.KimiDeltaAttentionLayerCache``): bf16 q, k, v, the
bf16 raw gate projections f and b with ``A_log``/``dt_bias``, gates formed in the kernels (``--gates formed``: fp32
g and bf16 β formed beforehand); the committed state fp32. Every row of ours (and the baseline, and fla) is checked
against the torch references (``kda_tree.naive``, ``gdn_tree.naive``; fp64) on layer 0 before it is timed: a row that
fails is reported and not timed, and the script exits 1.

Timing (as ``bench_kernels.py``): inputs for ``--layers`` distinct layers (rotated, so states are not all in L2), one
CUDA graph per measurement replaying all layers; per-layer µs = replay time / layers, median of ``--reps`` replays
timed with CUDA events after warm-up (autotuning happens before capture). Eager per-call medians (host launch
included) beside them; where a graph cannot be captured the eager time stands in (marked ``e``).

    python scripts/bench_kda.py [--T 16 32 64 128] [--kinds best_first deep15] [--layers 16] [--reps 50]
        [--gates raw|formed] [--heads 32] [--head-dim 128] [--baseline-bv 16 32] [--no-fla] [--no-baseline]
        [--no-neumann] [--strip CONFIG ...] [--sweep] [--out DIR]
    python scripts/bench_kda.py --interpret    # CPU smoke: 2 heads × 16, T 17, every row through Triton's
                                               # interpreter and checked; its timings mean nothing

(``PYTHONPATH=$PWD:$PWD/kernels``; fla is optional: ``scripts/gpu_check.sh kda`` installs the carried wheels.)
"""

from __future__ import annotations

import os
import sys

if "--interpret" in sys.argv:  # Triton picks compiled or interpreted at decoration time: set it before any import
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench_kernels import eager_time_us as cuda_eager_time_us  # noqa: E402 (this folder: the shared timers)
from bench_kernels import graph_time_us  # noqa: E402
from weaver_kernels.gdn_tree.chunk import gdn_tree_commit_triton, gdn_tree_verify_triton  # noqa: E402
from weaver_kernels.gdn_tree.dispatch import verify_form  # noqa: E402
from weaver_kernels.gdn_tree.naive import gdn_gates, gdn_tree_commit_ref, gdn_tree_verify_ref  # noqa: E402
from weaver_kernels.kda_tree.commit import kda_tree_commit_triton  # noqa: E402
from weaver_kernels.kda_tree.fused import kda_tree_verify_triton  # noqa: E402
from weaver_kernels.kda_tree.neumann import MAX_NODES as NEUMANN_MAX_NODES  # noqa: E402
from weaver_kernels.kda_tree.neumann import kda_tree_verify_neumann  # noqa: E402
from weaver_kernels.kda_tree.strip import MAX_NODES as STRIP_MAX_NODES  # noqa: E402
from weaver_kernels.kda_tree.strip import kda_tree_verify_strip  # noqa: E402
from weaver_kernels.kda_tree.naive import (  # noqa: E402
    kda_gates,
    kda_recurrent_ref,
    kda_tree_commit_ref,
    kda_tree_verify_ref,
)
from weaver_kernels.testing import (  # noqa: E402
    ancestor_mask,
    path_to,
    rel_rms,
    tree_of_kind,
)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# rel. RMS bounds of the pre-timing checks: o is bf16 (its rounding); u, Γ and the state are fp32 from the same gates
# (a wrong kernel is off by far more). fla is not ours: bf16 intermediates in its chunk form, β not rounded to bf16.
TOL = dict(o=1e-2, fp32=1e-3, fla=5e-2)


# ------------------------------------------------------------------------------------------------- baseline kernel
@triton.jit
def _kda_recurrent_tree_kernel(
    q, k, v, g, beta, a_log, dt_bias, s0, parents, o, inter, T, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, RAW_GATES: tl.constexpr,
):
    """One program per (value block, batch·value head): the nodes in topological order, each from its parent's state
    (in registers when the parent is the previous node, else reloaded from ``inter``; S0 for a root), one KDA step
    (decay per key channel, then the delta update), o written, and the node's [K, BV] state written to ``inter``.
    Contiguous inputs [B, T, heads, ·]."""
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = (i_bh // HV).to(tl.int64)
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    tile = o_k[:, None] * V + o_v[None, :]
    s0_ptr = s0 + (i_b * HV + i_hv) * K * V + tile
    st = i_b * 0 + HV * K * V  # int64 stride between nodes' states (T·HV·K·V passes 2^31 at large T)
    inter_base = inter + i_b * T * st + i_hv * K * V + tile
    if RAW_GATES:
        neg_a = -tl.exp(tl.load(a_log + i_hv).to(tl.float32))
        bias = tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    h = tl.load(s0_ptr, mask=m_h, other=0.0).to(tl.float32)
    for t in range(0, T):
        par = tl.load(parents + t).to(tl.int32)
        par_t = par + tl.full([BK, BV], 0, tl.int32)  # block-shaped predicates: the interpreter mishandles scalar
        is_root = par_t < 0  # & block masks
        reload = (par_t >= 0) & (par_t != t - 1)
        h_root = tl.load(s0_ptr, mask=m_h & is_root, other=0.0).to(tl.float32)
        h_par = tl.load(inter_base + tl.where(par >= 0, par, 0) * st, mask=m_h & reload, other=0.0)
        h = tl.where(is_root, h_root, tl.where(reload, h_par, h))

        row = i_b * T + t
        kt = tl.load(k + (row * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        qt = tl.load(q + (row * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        if L2NORM:
            kt = kt / tl.sqrt(tl.sum(kt * kt, axis=0) + 1e-6)
            qt = qt / tl.sqrt(tl.sum(qt * qt, axis=0) + 1e-6)
        vt = tl.load(v + (row * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        gt = tl.load(g + (row * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        bt = tl.load(beta + row * HV + i_hv).to(tl.float32)
        if RAW_GATES:  # KimiLinear's gates (kda_tree.naive.kda_gates): softplus as transformers', β in b's dtype
            x = gt + bias
            gt = neg_a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
            bt = (1.0 / (1.0 + tl.exp(-bt))).to(beta.dtype.element_ty).to(tl.float32)

        h = h * tl.exp(gt)[:, None]
        delta = bt * (vt - tl.sum(h * kt[:, None], axis=0))
        h = h + kt[:, None] * delta[None, :]
        ot = tl.sum(h * qt[:, None], axis=0) * scale
        tl.store(o + (row * HV + i_hv) * V + o_v, ot.to(o.dtype.element_ty), mask=m_v)
        tl.store(inter_base + t * st, h, mask=m_h)
        tl.debug_barrier()  # a later node may reload this state


def kda_recurrent_tree_verify(q, k, v, g, beta, s0, parents, inter, o, A_log=None, dt_bias=None, BV=32, num_warps=4):
    """Baseline verify: o ``[B, T, HV, V]`` and every node's state into ``inter [B, T, HV, K, V]`` (fp32)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    raw = A_log is not None
    _kda_recurrent_tree_kernel[(triton.cdiv(V, BV), B * HV)](
        q, k, v, g, beta, A_log if raw else s0, dt_bias if raw else s0, s0, parents, o, inter, T, K**-0.5,
        H=H, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV, L2NORM=True, RAW_GATES=raw,
        num_warps=num_warps, num_stages=1,
    )
    return o, inter


# ---------------------------------------------------------------------------------------------------------- timing
def sync():
    if torch.cuda.is_available() and not INTERPRET:
        torch.cuda.synchronize()


def eager_time_us(fns, reps, warm=3):
    """Median µs of single eager calls (``bench_kernels.py``'s CUDA events; the wall clock under the interpreter,
    where it means nothing)."""
    if not INTERPRET:
        return cuda_eager_time_us(fns, reps, warm)
    for _ in range(warm):
        for f in fns:
            f()
    times = []
    for r in range(reps):
        t0 = time.perf_counter()
        fns[r % len(fns)]()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def timed(fns, reps):
    out = {}
    try:
        out["eager_us"] = eager_time_us(fns, reps, warm=1 if INTERPRET else 3)
    except Exception as e:  # noqa: BLE001
        out["eager_error"] = repr(e)[:300]
    if not INTERPRET:
        try:
            out["graph_us"] = graph_time_us(fns, reps)
        except Exception as e:  # noqa: BLE001  (e.g. a host sync inside a foreign kernel: eager stands in)
            out["graph_error"] = repr(e)[:300]
            torch.cuda.synchronize()
    out["us"] = out.get("graph_us", out.get("eager_us", float("nan")))
    out["how"] = "graph" if "graph_us" in out else "eager"
    return out


# ---------------------------------------------------------------------------------------------------------- inputs
def make_tree(T, kind):
    """The bench's tree of ``kind`` at T nodes (one fixed seed per T and kind: every script times the same trees)."""
    return tree_of_kind(T, kind, random.Random(T + {"chain": 7, "deep15": 3}.get(kind, 0)))


def make_layer(T, H, K, seed, dev, raw):
    """One layer's inputs as ``KimiDeltaAttentionLayerCache`` / ``GatedDeltaNetLayerCache`` hand them to the ops (bf16
    conv outputs and raw gate projections; fp32 committed states), and the GDN layer's at the same heads and dims."""
    gen = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    rn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x = dict(q=rn(1, T, H, K), k=rn(1, T, H, K), v=rn(1, T, H, K),
             f=rn(1, T, H, K) * 3,  # spread so some channels nearly forget and some nearly keep (kda_inputs' regime)
             b=rn(1, T, H), A_log=rn(H) * 0.5, dt_bias=rn(H * K),
             a=rn(1, T, H), gA_log=rn(H) * 0.5, gdt_bias=rn(H),  # GDN's scalar-gate projections
             S0=rn(1, H, K, K) * 0.5, gS0=rn(1, H, K, K) * 0.5)
    for n in ("q", "k", "v", "f", "b", "a"):
        x[n] = x[n].to(bf)
    x = {n: t.to(dev) for n, t in x.items()}
    x["S"], x["gS"] = x["S0"].clone(), x["gS0"].clone()
    # the gates the kernels form from the raw projections (the references' inputs; --gates formed's kernel inputs)
    x["g"], x["beta"] = kda_gates(x["f"], x["b"], x["A_log"], x["dt_bias"])
    x["gg"], x["gbeta"] = gdn_gates(x["a"], x["b"], x["gA_log"], x["gdt_bias"])
    if INTERPRET and raw:  # the interpreter truncates where the GPU rounds β to bf16: the references follow it
        trunc = (torch.sigmoid(x["b"].float()).view(torch.int32) & -65536).view(torch.float32).to(bf)
        x["beta"], x["gbeta"] = trunc, trunc
    if raw:  # what the kernels read: the raw projections, gates formed in the launch
        x["kg"], x["kb"], x["kraw"] = x["f"], x["b"], dict(A_log=x["A_log"], dt_bias=x["dt_bias"])
        x["gk_g"], x["gk_b"], x["graw"] = x["a"], x["b"], dict(A_log=x["gA_log"], dt_bias=x["gdt_bias"])
    else:
        x["kg"], x["kb"], x["kraw"] = x["g"], x["beta"], {}
        x["gk_g"], x["gk_b"], x["graw"] = x["gg"], x["gbeta"], {}
    return x


def d(t):
    return t.double()


def check(res, name, errs, bound):
    """Record a row's errors; False (and the row marked) if one is above its bound: that row is not timed."""
    ok = all(e <= bound[k] for k, e in errs.items())
    res.setdefault("checks", {})[name] = dict(ok=ok, **{k: float(f"{e:.3e}") for k, e in errs.items()})
    if not ok:
        print(f"CHECK FAILED: {name} at T={res['T']} ({res['kind']}): {errs} (bounds {bound}); not timed", flush=True)
    return ok


def strip_config(name: str) -> dict:
    """The strip form's keyword arguments from a ``--strip`` config such as ``BV=32,num_warps=8,precision=ieee``."""
    kw = {}
    for item in filter(None, name.split(",")):
        key, value = item.split("=")
        kw[key] = value if key.endswith("precision") else int(value)
    return kw


def sweep_configs(sweep: bool, K: int, V: int):
    """The fused form's launch configs that ``--sweep`` times: warps (every launch's), value block, key chunk."""
    if not sweep:
        return []
    return [(w, bv, c) for w in (1, 2, 4, 8) for bv in (16, 32) for c in (16, 32) if bv <= V and c <= K]


# ------------------------------------------------------------------------------------------------------ one tree
def bench_tree(T, kind, layers, args, dev):
    parents, dep, leaf = make_tree(T, kind)
    mask = ancestor_mask(parents, dev)
    par_t = torch.tensor(parents, device=dev, dtype=torch.int32)
    path = torch.tensor(path_to(parents, leaf), device=dev)
    res = dict(T=T, kind=kind, max_depth=max(dep), path_len=path.numel())
    x = layers[0]
    f32 = dict(o=TOL["o"], u=TOL["fp32"], gamma=TOL["fp32"], state=TOL["fp32"])

    # ---- KDA tree: check layer 0 against the fp64 reference fed the same gates, then time
    ro, ru, rg = kda_tree_verify_ref(d(x["q"]), d(x["k"]), d(x["v"]), d(x["g"]), d(x["beta"]), d(x["S0"]), mask,
                                     use_qk_l2norm_in_kernel=True)
    Sr = kda_tree_commit_ref(d(x["S0"]), d(x["k"]), ru, rg, path, use_qk_l2norm_in_kernel=True)

    forms = (("kda", kda_tree_verify_triton), ("kda_neumann", kda_tree_verify_neumann),
             ("kda_neumann_ieee", functools.partial(kda_tree_verify_neumann, precision="ieee")),
             ("kda_neumann_bkc32", functools.partial(kda_tree_verify_neumann, BKC=32)))
    if args.no_neumann:
        forms = forms[:1]
    forms += (("kda_strip", kda_tree_verify_strip),)
    forms += tuple((f"strip_{c}", functools.partial(kda_tree_verify_strip, **strip_config(c))) for c in args.strip)
    forms += tuple((f"sweep_w{w}_bv{bv}_bkc{c}", functools.partial(kda_tree_verify_triton, num_warps=w, BV=bv, BKC=c))
                   for w, bv, c in sweep_configs(args.sweep, x["k"].shape[-1], x["v"].shape[-1]))
    for name, verify in forms:
        if (name.startswith(("kda_strip", "strip_")) and T > STRIP_MAX_NODES) or (
                name.startswith("kda_neumann") and T > NEUMANN_MAX_NODES) or (name.endswith("bkc32")
                                                                          and x["k"].shape[-1] < 32):
            continue  # (past the Neumann form's nodes; 32 channels per chunk need K >= 32)

        def kverify(y, verify=verify):
            return verify(y["q"], y["k"], y["v"], y["kg"], y["kb"], y["S0"], mask, use_qk_l2norm_in_kernel=True,
                          **y["kraw"])

        o, u, gm = kverify(x)
        S = x["S0"].clone()
        kda_tree_commit_triton(S, x["k"], u, gm, path, use_qk_l2norm_in_kernel=True)
        if not check(res, name, dict(o=rel_rms(o, ro), u=rel_rms(u, ru), gamma=rel_rms(gm, rg), state=rel_rms(S, Sr)),
                     f32):
            continue

        def kstep(y, kverify=kverify):
            def f():
                _, u_, g_ = kverify(y)
                kda_tree_commit_triton(y["S"], y["k"], u_, g_, path, use_qk_l2norm_in_kernel=True)
            return f

        res[f"{name}_verify"] = timed([lambda y=y, kverify=kverify: kverify(y) for y in layers], args.reps)
        if name == "kda":  # (the commit is one kernel for both forms)
            pending = [kverify(y)[1:] for y in layers]  # each layer's u and Γ, for the commit alone
            res["kda_commit"] = timed([lambda y=y, p=p: kda_tree_commit_triton(y["S"], y["k"], p[0], p[1], path,
                                                                               True)
                                       for y, p in zip(layers, pending)], args.reps)
        res[f"{name}_step"] = timed([kstep(y) for y in layers], args.reps)

    # ---- GDN tree at the same heads and dims: its default form (and the fused form beside it)
    gro, gru, grg = gdn_tree_verify_ref(d(x["q"]), d(x["k"]), d(x["v"]), d(x["gg"]), d(x["gbeta"]), d(x["gS0"]), mask,
                                        use_qk_l2norm_in_kernel=True)
    gSr = gdn_tree_commit_ref(d(x["gS0"]), d(x["k"]), gru, grg, path, use_qk_l2norm_in_kernel=True)
    res["gdn_default_form"] = verify_form(T)
    for impl in dict.fromkeys([None, "fused"]):  # the default, then the fused form where the default is another
        if impl == "fused" and res["gdn_default_form"] == "fused":
            continue
        name = "gdn" if impl is None else f"gdn_{impl}"

        def gverify(y, impl=impl):
            return gdn_tree_verify_triton(y["q"], y["k"], y["v"], y["gk_g"], y["gk_b"], y["gS0"], mask,
                                          use_qk_l2norm_in_kernel=True, impl=impl, **y["graw"])

        o, u, gm = gverify(x)
        S = x["gS0"].clone()
        gdn_tree_commit_triton(S, x["k"], u, gm, path, use_qk_l2norm_in_kernel=True)
        if not check(res, name, dict(o=rel_rms(o, gro), u=rel_rms(u, gru), gamma=rel_rms(gm, grg),
                                     state=rel_rms(S, gSr)), f32):
            continue

        def gstep(y, gverify=gverify):
            def f():
                _, u_, g_ = gverify(y)
                gdn_tree_commit_triton(y["gS"], y["k"], u_, g_, path, use_qk_l2norm_in_kernel=True)
            return f

        if impl is None:
            res["gdn_verify"] = timed([lambda y=y: gverify(y) for y in layers], args.reps)
        res[f"{name}_step"] = timed([gstep(y) for y in layers], args.reps)

    # ---- baseline: every node's state written, the accepted one copied; its best value block
    if not args.no_baseline:
        B, H, K = 1, x["q"].shape[2], x["q"].shape[3]
        inter = torch.empty(B, T, H, K, K, device=dev)
        ob = torch.empty_like(x["v"])
        res["baseline_state_MB"] = inter.numel() * 4 / 1e6
        for bv in args.baseline_bv:
            def bverify(y, bv=bv):
                return kda_recurrent_tree_verify(y["q"], y["k"], y["v"], y["kg"], y["kb"], y["S0"], par_t, inter, ob,
                                                 BV=bv, **y["kraw"])

            try:
                bverify(x)
                S = x["S0"].clone()
                S.copy_(inter[:, leaf])
            except Exception as e:  # noqa: BLE001  (a block size that does not fit: report it, time the others)
                print(f"baseline BV={bv} at T={T} failed: {repr(e)[:200]}")
                continue
            if not check(res, f"baseline_bv{bv}", dict(o=rel_rms(ob, ro), state=rel_rms(S, Sr)), f32):
                continue

            def bstep(y, bverify=bverify):
                def f():
                    bverify(y)
                    y["S"].copy_(inter[:, leaf])
                return f

            r = timed([bstep(y) for y in layers], args.reps)
            r["BV"] = bv
            if "baseline" not in res or r["us"] < res["baseline"]["us"]:
                res["baseline"] = r
    return res


def bench_fla(T, layers, args, fla, dev):
    """fla's KDA on a chain of T tokens (the same layers' inputs as a sequence): output + final state."""
    out = {}
    x = layers[0]
    ro, rS = kda_recurrent_ref(d(x["q"]), d(x["k"]), d(x["v"]), d(x["g"]), d(x["beta"]), d(x["S0"]),
                               use_qk_l2norm_in_kernel=True)
    if args.gates == "raw":  # fla forms the gates in the kernel too: g raw + A_log/dt_bias, β = sigmoid(b)
        kw = lambda y: dict(g=y["f"], beta=y["b"], A_log=y["A_log"], dt_bias=y["dt_bias"],  # noqa: E731
                            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    else:
        kw = lambda y: dict(g=y["g"], beta=y["beta"])  # noqa: E731
    for name in ("chunk_kda", "fused_recurrent_kda"):
        fn = getattr(fla, name)

        def call(y, fn=fn):
            return fn(q=y["q"], k=y["k"], v=y["v"], initial_state=y["S0"], output_final_state=True,
                      use_qk_l2norm_in_kernel=True, **kw(y))

        try:
            with torch.inference_mode():
                o, S = call(x)
            errs = dict(o=rel_rms(o, ro), state=rel_rms(S, rS))
            ok = all(e <= TOL["fla"] for e in errs.values())
            out[name] = dict(check=dict(ok=ok, **{k: float(f"{e:.3e}") for k, e in errs.items()}))
            if not ok:
                print(f"CHECK FAILED: fla {name} at T={T}: {errs} (bound {TOL['fla']}); not timed", flush=True)
                continue
            with torch.inference_mode():
                out[name].update(timed([lambda y=y: call(y) for y in layers], args.reps))
        except Exception as e:  # noqa: BLE001
            out[name] = dict(error=repr(e)[:300])
            print(f"fla {name} at T={T} failed: {repr(e)[:300]}", flush=True)
            sync()
    return out


# ---------------------------------------------------------------------------------------------------------- report
def configs_line(r, prefix: str, title: str) -> list[str]:
    """One line of a tree's rows named ``prefix…_step`` (extra configs of a form), fastest first, or none."""
    timed = sorted((us(r, key)[0], key[len(prefix):-len("_step")]) for key in r
                   if key.startswith(prefix) and key.endswith("_step"))
    return [f"{title}: " + ", ".join(f"{name} {t:.1f}" for t, name in timed)] if timed else []


def us(r, key):
    v = (r.get(key) or {}).get("us", float("nan"))
    return v, ("" if (r.get(key) or {}).get("how", "graph") == "graph" else "e")


def cell(r, key):
    v, mark = us(r, key)
    return f"{v:.1f}{mark}" if v == v else "–"


def ratio(a, b):
    return a / b if a == a and b == b and b > 0 else float("nan")


def table(results, fla_res, meta):
    H, K = meta["heads"], meta["head_dim"]
    lines = [
        f"device: {meta['device']} | torch {meta['torch']} | triton {meta['triton']} | fla {meta['fla']} | "
        f"{meta['date']}",
        f"command: {meta['command']}",
        f"shapes: every row batch 1, {H} q/k heads = {H} value heads, K = V = {K}; q/k/v bf16, committed states fp32; "
        f"gates: {meta['gates_note']}",
        "rows: KDA = kda_tree_verify_triton + kda_tree_commit_triton (per-channel gates g [1, T, H, K]), KDA Neumann = "
        "kda_tree_verify_neumann (solve dots tf32x3, or IEEE; key channels 16 per chunk, or 32) + the same commit; KDA "
        "strip = kda_tree_verify_strip + the same commit (the ops' verify up to 64 nodes); "
        "GDN = gdn_tree_verify_triton (impl=None: the form named) + gdn_tree_commit_triton at the same heads/dims (scalar "
        "gates [1, T, H]); baseline = this script's recurrent Triton KDA kernel writing all T node states "
        f"[{K}, {K}] fp32 + torch copy of the accepted one; fla = fla.ops.kda on a chain of T tokens (output + final "
        "state), not a tree",
        f"per layer, µs: {meta['timing']}",
        "",
        "| tree | T | depth | path | KDA verify | KDA commit | KDA verify+commit | KDA strip verify+commit "
        "| KDA Neumann verify "
        "| KDA Neumann verify+commit | KDA Neumann (IEEE dots) verify+commit | KDA Neumann (BKC 32) verify+commit "
        "| GDN verify+commit (form) "
        "| KDA (ops' form) / GDN (bar ≤ 1.5×) | baseline: all states + copy (BV) | baseline / KDA (ops' form) "
        "(bar ≥ 5×) | GDN fused v+c "
        "| fla chunk_kda (chain) | fla fused_recurrent_kda (chain) |",
        "|---" * 19 + "|",
    ]
    for r in results:
        k, _ = us(r, "kda_strip_step" if "kda_strip_step" in r else "kda_step")  # the ops' form at this T
        g, _ = us(r, "gdn_step")
        b, _ = us(r, "baseline")
        fr = fla_res.get(r["T"], {})
        fla_cells = [cell(fr, n) if "error" not in fr.get(n, {}) else "error" for n in ("chunk_kda",
                                                                                        "fused_recurrent_kda")]
        lines.append(
            f"| {r['kind']} | {r['T']} | {r['max_depth']} | {r['path_len']} | {cell(r, 'kda_verify')} "
            f"| {cell(r, 'kda_commit')} | {cell(r, 'kda_step')} | {cell(r, 'kda_strip_step')} "
            f"| {cell(r, 'kda_neumann_verify')} "
            f"| {cell(r, 'kda_neumann_step')} | {cell(r, 'kda_neumann_ieee_step')} "
            f"| {cell(r, 'kda_neumann_bkc32_step')} "
            f"| {cell(r, 'gdn_step')} ({r['gdn_default_form']}) "
            f"| {ratio(k, g):.2f}× | {cell(r, 'baseline')} (BV{(r.get('baseline') or {}).get('BV', '-')}) "
            f"| {ratio(b, k):.1f}× | {cell(r, 'gdn_fused_step') if 'gdn_fused_step' in r else '(same)'} "
            f"| {fla_cells[0]} | {fla_cells[1]} |")
    lines.append("")
    for r in results:
        if r["T"] != 64:
            continue
        g, b = us(r, "gdn_step")[0], us(r, "baseline")[0]
        verdict = lambda ok, v: ("n/a" if v != v or INTERPRET  # noqa: E731  (interpreter times judge nothing)
                                 else "PASS" if ok else "FAIL")
        for form, key in (("fused", "kda_step"), ("strip", "kda_strip_step"), ("Neumann", "kda_neumann_step"),
                          ("Neumann, IEEE dots", "kda_neumann_ieee_step"),
                          ("Neumann, BKC 32", "kda_neumann_bkc32_step")):
            k = us(r, key)[0]
            rk, rb = ratio(k, g), ratio(b, k)
            lines.append(f"bar at T = 64, {r['kind']}, KDA {form}: KDA/GDN verify+commit = {rk:.2f}× "
                         f"(≤ 1.5×: {verdict(rk <= 1.5, rk)}); "
                         f"baseline/KDA = {rb:.1f}× (≥ 5×: {verdict(rb >= 5, rb)})")
    for r in results:
        lines += configs_line(r, "strip_", f"strip form configs ({r['kind']}, T = {r['T']}; verify + commit µs, "
                              f"fastest first; the default {us(r, 'kda_strip_step')[0]:.1f})")
    for r in results:
        lines += configs_line(r, "sweep_", f"sweep of the fused form ({r['kind']}, T = {r['T']}; warps, value block, "
                              "key chunk; verify + commit µs, fastest first; the default is w4_bv16_bkc16)")
    lines.append("")
    lines.append("checks before timing (layer 0, rel. RMS against the fp64 references; a failed row is not timed):")
    for r in results:
        lines.append(f"- {r['kind']} T={r['T']}: " + "; ".join(
            f"{n} {'ok' if c['ok'] else 'FAILED'} " + " ".join(f"{k}={v:.1e}" for k, v in c.items() if k != "ok")
            for n, c in r.get("checks", {}).items()))
    for T, fr in fla_res.items():
        lines.append(f"- fla chain T={T}: " + "; ".join(
            f"{n} " + (f"error {c['error'][:120]}" if "error" in c else
                       f"{'ok' if c['check']['ok'] else 'FAILED'} "
                       + " ".join(f"{k}={v:.1e}" for k, v in c["check"].items() if k != "ok"))
            for n, c in fr.items()))
    if INTERPRET:
        lines.append("")
        lines.append("Triton interpreter on the CPU: the checks are real, the timings are the interpreter's wall clock "
                     "and mean nothing.")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, nargs="+", default=None,
                    help="tree nodes (default 16 32 64 128, issue #31's list; --interpret: 17)")
    ap.add_argument("--kinds", nargs="+", default=None, choices=("best_first", "deep15", "chain"),
                    help="tree shapes (default best_first deep15; --interpret: best_first)")
    ap.add_argument("--heads", type=int, default=None, help="q/k = value heads (default 32, Kimi Linear's; "
                                                            "--interpret: 2)")
    ap.add_argument("--head-dim", type=int, default=None, help="K = V (default 128; --interpret: 16)")
    ap.add_argument("--layers", type=int, default=None, help="distinct layers' inputs, rotated (default 16)")
    ap.add_argument("--reps", type=int, default=None, help="timed replays per measurement (default 50)")
    ap.add_argument("--gates", choices=("raw", "formed"), default="raw",
                    help="raw: bf16 projections f, b + A_log/dt_bias, gates formed in the kernels (the model's feed); "
                         "formed: fp32 g and bf16 β formed beforehand")
    ap.add_argument("--baseline-bv", type=int, nargs="+", default=[16, 32], help="baseline value blocks to try")
    ap.add_argument("--sweep", action="store_true",
                    help="also time the fused form at every launch config of warps (1 2 4 8), value block (16 32) and "
                         "key chunk (16 32), each checked first")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--no-neumann", action="store_true", help="skip the Neumann form's rows")
    ap.add_argument("--strip", nargs="+", default=[], metavar="CONFIG",
                    help="also time the strip form at these configs, each comma-separated keyword=value pairs of "
                         "kda_tree_verify_strip (e.g. BV=32,num_warps=8 or pair_precision=tf32x3)")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--interpret", action="store_true",
                    help="CPU smoke run: tiny shape, every kernel through Triton's interpreter, checked")
    ap.add_argument("--out", default=None, help="folder for bench_kda.json and bench_kda.md (created; existing "
                                                "files there are refused)")
    args = ap.parse_args()
    small = args.interpret
    args.T = args.T or ([17] if small else [16, 32, 64, 128])
    args.kinds = args.kinds or (["best_first"] if small else ["best_first", "deep15"])
    args.heads = args.heads or (2 if small else 32)
    args.head_dim = args.head_dim or (16 if small else 128)
    args.layers = args.layers or (1 if small else 16)
    args.reps = args.reps or (2 if small else 50)
    if args.out:
        files = [os.path.join(args.out, f"bench_kda.{e}") for e in ("json", "md")]
        if any(os.path.lexists(f) for f in files):  # refused before minutes of timing, not after
            ap.error(f"argument --out: {args.out} already holds bench_kda.json/.md; choose another folder")
    if not small and not torch.cuda.is_available():
        ap.error("no CUDA device: run with --interpret for the CPU smoke run")
    dev = "cpu" if small else "cuda"

    fla, fla_note = None, None
    if args.no_fla:
        fla_note = "skipped (--no-fla)"
    else:  # (under --interpret its fused_recurrent_kda runs; chunk_kda's autotuner wants a GPU driver and fails)
        try:
            import fla.ops.kda as fla  # noqa: F811
        except Exception as e:  # noqa: BLE001
            fla_note = f"not available: {repr(e)[:200]}"
    if fla_note:
        print("fla:", fla_note)
    fla_mod = sys.modules.get("fla")
    meta = dict(
        device="CPU (Triton interpreter)" if small else torch.cuda.get_device_name(), torch=torch.__version__,
        triton=triton.__version__, fla=getattr(fla_mod, "__version__", None) if fla else fla_note,
        fla_backend=(("flash_kda (CUTLASS)" if importlib.util.find_spec("flash_kda") else "triton") if fla else None),
        python=platform.python_version(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=" ".join(sys.argv), heads=args.heads, head_dim=args.head_dim, layers=args.layers, reps=args.reps,
        gates=args.gates, interpret=small,
        gates_note=("raw bf16 projections (KDA f [1, T, H, K], GDN a [1, T, H], b [1, T, H]) + fp32 A_log/dt_bias, "
                    "formed in the kernels (fla: use_gate_in_kernel, use_beta_sigmoid_in_kernel)"
                    if args.gates == "raw" else "formed beforehand: g fp32, β bf16"),
        timing=("Triton interpreter wall clock, median of eager calls: meaningless" if small else
                f"CUDA-graph replay of {args.layers} layers / {args.layers}, median of {args.reps} replays after "
                "warm-up (CUDA events); 'e' = eager per-call median (no graph)"),
    )
    print(json.dumps(meta), flush=True)

    results, fla_res, failed = [], {}, False
    for T in args.T:
        H, K = args.heads, args.head_dim
        layers = [make_layer(T, H, K, seed=T * 1000 + i, dev=dev, raw=args.gates == "raw") for i in range(args.layers)]
        for kind in args.kinds:
            try:
                r = bench_tree(T, kind, layers, args, dev)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
                failed = True
                continue
            failed |= not all(c["ok"] for c in r.get("checks", {}).values())
            results.append(r)
            print(json.dumps(r), flush=True)
        if fla is not None:
            fla_res[T] = bench_fla(T, layers, args, fla, dev)
            failed |= any(not c.get("check", {}).get("ok", True) for c in fla_res[T].values())
            print(json.dumps(dict(T=T, fla=fla_res[T])), flush=True)
        del layers
        if not small:
            torch.cuda.empty_cache()

    md = table(results, fla_res, meta)
    print()
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_kda.json"), "x") as f:
            json.dump(dict(meta=meta, results=results, fla={str(T): r for T, r in fla_res.items()}), f, indent=1)
        with open(os.path.join(args.out, "bench_kda.md"), "x") as f:
            f.write(md + "\n")
    if failed:
        print("some rows failed their checks or raised: see above", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

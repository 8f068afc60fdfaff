"""Triton kernels for the tree gated delta rule (DESIGN.md §5): rollback-free verify and accepted-path commit.

Verify (one launch, writes no state). For a tree of T nodes in topological order with committed state S0, per value
head::

    Γ_i   = Σ_{j ∈ path(i)} g_j                     (path sums instead of cumsum: one masked row reduction)
    D_ij  = exp(Γ_i − Γ_j) if j ∈ path(i) else 0    (ancestor mask instead of tril, applied before the exp)
    A     = β ⊙ (K Kᵀ ⊙ D ⊙ M_strict)
    (I + A) U = β ⊙ (V − exp(Γ) ⊙ K S0)
    O     = scale · (exp(Γ) ⊙ Q S0 + (Q Kᵀ ⊙ D) U)

The masked unit-lower-triangular solve is blockwise forward substitution over row blocks of BT=16 nodes (fla's
``solve_tril`` idea, left-looking): for block i, ``U_i = (I + A_ii)^{-1} (rhs_i − A_{i,<i} U_{<i})``. The 16×16
diagonal inverse is exact for a strictly lower ``A_ii`` (nilpotent, N^16 = 0) as the product
``(I−A)(I+A²)(I+A⁴)(I+A⁸)`` — six tiny fp32 dots instead of 16 dependent row steps. Solved rows of U go straight to
the ``u`` output, which doubles as the scratch the later blocks read back (same program, after a CTA barrier).
Everything that does not depend on U (K S0, Q S0, the [16, T] score rows, Γ, D) is fused in the same pass, so a
head's S0 tile is read once and no [T, T] matrix ever touches memory.

Grid: (V / BV, B·HV). Each program owns one value head and BV value columns and holds its S0 tile ([K, BV]) in
registers; earlier blocks are visited BC (≤ 64) columns at a time. Limit: T ≤ 256 nodes (``MAX_NODES``, so that a
budget of 128 drafts plus the root fits): the per-block Γ reduction and the read-back of U use full-width
[16, T_pad] / [T_pad, BV] tiles, and the serial chain of ⌈T/16⌉ row blocks costs ~7-8 µs per block on the H200
(latency-bound), so time grows linearly past 128 nodes.

For shallow trees (a block drafter's: depth ≤ block size − 1) of 49-64 or 97-128 nodes the Neumann form (``impl="neumann"``,
below) has no serial row blocks at all: U = Σ_{m ≤ depth} N^m R by ``depth`` dense Horner steps, from coefficients a
parallel prep launch writes; it is what ``impl=None`` takes when the caller bounds the depth (``max_depth``).

An alternative three-launch form (``impl="split"``, below) moves all inverses and K Kᵀ products into parallel
launches; it measured slower on the H200 and is not the default. The resident form (``impl="resident"``, below)
solves right-looking with every row's right-hand side in registers (no read-back, no barrier); it is the default
for 49-64 nodes when no depth bound selects the Neumann form.

Commit (one launch, one read + one write of S): for the accepted leaf ℓ,
``S* = exp(Γ_ℓ) S0 + Σ_{j ∈ path(ℓ)} exp(Γ_ℓ − Γ_j) k_j u_jᵀ``, in place. ``path`` may be right-padded with -1 so
a fixed-size buffer works under CUDA graphs.

Precision: accumulation is fp32. Products of 16-bit inputs are exact; dots with an fp32 operand (S0, U) use tf32
when q/k/v are 16-bit and IEEE fp32 when they are fp32; the diagonal inverse and the commit are IEEE fp32 by default
(``inverse_precision`` / ``precision`` = ``"tf32x3"`` run them on tensor cores at about fp32 accuracy); the Neumann
form's Horner products are tf32 for 16-bit inputs (``NEUMANN_PRECISION``) and IEEE for fp32 ones.
With ``use_qk_l2norm_in_kernel`` the norms are applied as fp32 row/column scalings of the raw dots (no
re-rounding of normalised vectors).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils import is_interpret, launch_ctx, next_pow2
from .naive import gdn_gates

MAX_NODES = 256
# T at or above which gdn_tree_verify_triton uses the split (3-launch) form by default. Measured on the H200 (run 2,
# BENCHMARKS.md): split is slower than fused at every T ≤ 128 (T=64: 37.9 vs 27.7 µs), so by default never.
SPLIT_MIN_NODES = MAX_NODES + 1

_INTERPRET = is_interpret()  # evaluated when this module is executed (see utils.load_interpreted)


# Only Triton builtins and this module's own @triton.jit helpers are used inside the kernels (no tl.sum/tl.cdiv/
# tl.sigmoid, which are @jit functions of triton.language itself): utils.load_interpreted can then run this module
# on Triton's CPU interpreter even in a process that imported Triton in compiled mode.
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _rsum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _add)


@triton.jit
def _decay(a, a_log, dt_bias, i_hv):
    """Qwen3.5's g of value head ``i_hv`` from the raw projection a: −exp(A_log) · softplus(a + dt_bias).

    softplus(x) = max(x, 0) + log1p(exp(−|x|)), log1p by Kahan's correction (no log1p builtin): a plain
    log(1 + e) loses e's digits for x ≪ 0, where long-memory heads sit (4e-4 relative at x = −10, 6 % at −16,
    all of it from −17 down; this form: ≤ 1.2e-7 there, fp32 on CPU).
    Past x ≈ 17 it is x in fp32, as F.softplus's linear branch."""
    x = a + tl.load(dt_bias + i_hv).to(tl.float32)
    e = tl.exp(-tl.abs(x))
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
    return -tl.exp(tl.load(a_log + i_hv).to(tl.float32)) * (tl.maximum(x, 0.0) + log1p)

@triton.jit
def _beta(b, dtype: tl.constexpr):
    """β = sigmoid(b) of the raw projection, rounded to b's dtype (as the module computes it), as fp32."""
    return (1.0 / (1.0 + tl.exp(-b))).to(dtype).to(tl.float32)


@triton.jit
def _root_step(q_base, k_base, v_base, b_base, o_k, m_k, o_v, m_v, S, g0, beta_dtype: tl.constexpr,
               L2NORM: tl.constexpr, RAW_GATES: tl.constexpr):
    """Node 0 as one recurrent step from the committed tile ``S [BK, BV]`` (the root step of both forms): its q0
    and k0 (unit with L2NORM), e^{g0}, and u0 = β0 (v0 − e^{g0} k0ᵀ S) — the state after it is e^{g0} S + k0 u0ᵀ."""
    k0 = tl.load(k_base + o_k, mask=m_k, other=0.0).to(tl.float32)
    q0 = tl.load(q_base + o_k, mask=m_k, other=0.0).to(tl.float32)
    v0 = tl.load(v_base + o_v, mask=m_v, other=0.0).to(tl.float32)
    b0 = tl.load(b_base).to(tl.float32)
    if RAW_GATES:
        b0 = _beta(b0, beta_dtype)
    if L2NORM:
        k0 = k0 * tl.rsqrt(_rsum(k0 * k0, axis=0) + 1e-6)
        q0 = q0 * tl.rsqrt(_rsum(q0 * q0, axis=0) + 1e-6)
    e0 = tl.exp(g0)
    u0 = b0 * (v0 - e0 * _rsum(k0[:, None] * S, axis=0))
    return q0, k0, e0, u0


@triton.jit
def _block_inverse(kk_d, D_d, b_i, BT: tl.constexpr, LOG2_BT: tl.constexpr, PREC: tl.constexpr):
    """(I + A_d)^{-1} of one row block, A_d = β ⊙ (K Kᵀ ⊙ D) strictly below the diagonal:
    Σ_{m<BT} (−A_d)^m = (I + N)(I + N²)(I + N⁴)…, N = −A_d strictly lower (N^BT = 0), i.e. 2·(LOG2_BT − 1) dots."""
    o_r = tl.arange(0, BT)
    X = -tl.where(o_r[:, None] > o_r[None, :], kk_d * D_d * b_i[:, None], 0.0)
    P = tl.where(o_r[:, None] == o_r[None, :], 1.0, 0.0) + X
    for _ in tl.static_range(LOG2_BT - 1):
        X = tl.dot(X, X, input_precision=PREC)
        P = P + tl.dot(P, X, input_precision=PREC)
    return P


# Candidate configs (tests exercise all of them; scripts/bench_kernels.py can sweep them). The default is one config,
# not an autotuner sweep: Triton's autotuner times eager launches, which at these ~5-60 µs kernels mostly measures
# host launch overhead and picked a 2-wave config at T=16 on the H200 (12.2 µs instead of 7.6). BV=32 / 4 warps
# (~250 registers → 2 CTAs per SM) runs the Qwen3.6-27B shape (4 × 48 = 192 programs) in one wave; it is what the
# autotuner chose at T = 64 and 128 (BENCHMARKS.md, Kernels).
# num_stages=1 on purpose: the loop reads back rows of `u` that the same program stored one iteration earlier;
# a software-pipelined (prefetched) load could be issued before that store and its barrier.
_VERIFY_CANDIDATES = [
    triton.Config({"BV": bv}, num_warps=w, num_stages=1) for bv, w in ((16, 4), (32, 4), (32, 8), (64, 8))
]
if _INTERPRET:
    _VERIFY_CONFIGS = [triton.Config({"BV": 16}, num_warps=4, num_stages=1)]
else:
    _VERIFY_CONFIGS = [triton.Config({"BV": 32}, num_warps=4, num_stages=1)]


@triton.jit
def _gdn_tree_verify_kernel(
    q, k, v, g, beta, s0, tmask, o, u, gamma, a_log, dt_bias,
    T, scale,
    sq_b, sq_t, sq_h,
    sk_b, sk_t, sk_h,
    sv_b, sv_t, sv_h,
    sg_b, sg_t, sg_h,
    sb_b, sb_t, sb_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    TP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, LOG2_BT: tl.constexpr,
    BC: tl.constexpr, L2NORM: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, INV_PREC: tl.constexpr,
    RAW_GATES: tl.constexpr, PEEL: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // HV
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_n = tl.arange(0, TP)
    m_n = o_n < T
    o_r = tl.arange(0, BT)
    o_c = tl.arange(0, BC)

    i_b64 = i_b.to(tl.int64)
    q_base = q + i_b64 * sq_b + i_h * sq_h
    k_base = k + i_b64 * sk_b + i_h * sk_h
    v_base = v + i_b64 * sv_b + i_hv * sv_h
    g_base = g + i_b64 * sg_b + i_hv * sg_h
    b_base = beta + i_b64 * sb_b + i_hv * sb_h
    s_base = s0 + (i_b64 * HV + i_hv) * K * V
    # outputs are contiguous [B, T, HV, V] / [B, T, HV]
    o_base = o + i_b64 * T * HV * V + i_hv * V
    u_base = u + i_b64 * T * HV * V + i_hv * V
    gm_base = gamma + i_b64 * T * HV + i_hv

    g_all = tl.load(g_base + o_n * sg_t, mask=m_n, other=0.0).to(tl.float32)
    if RAW_GATES:  # g holds the raw projection a (beta: b, per block below)
        g_all = tl.where(m_n, _decay(g_all, a_log, dt_bias, i_hv), 0.0)
    # committed state tile [BK, BV], read once
    S = tl.load(s_base + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0).to(tl.float32)

    m_kv = m_k[None, :]
    m_vv = m_v[None, :]

    # PEEL (T = 16n + 1, e.g. a budget of 16n drafts + the root): when node 0 is an ancestor of every node, it runs
    # as one recurrent step (S ← S after node 0) and the solve covers nodes 1.. in n row blocks instead of n + 1.
    # The path sums Γ stay whole (they are what the commit reads); the rows' decays from S are then e^{Γ − g_0}.
    R0 = 0
    g_root = 0.0
    if PEEL:
        col0 = tl.load(tmask + o_n * T, mask=m_n, other=1)
        missing = _rsum(tl.where(col0 != 0, 0, 1), axis=0)  # nodes that do not descend from node 0
        rooted = missing == 0
        g0 = _rsum(tl.where(o_n == 0, g_all, 0.0), axis=0)
        q0, k0, e0, u0 = _root_step(q_base, k_base, v_base, b_base, o_k, m_k, o_v, m_v, S, g0,
                                    beta.dtype.element_ty, L2NORM, RAW_GATES)
        S_root = e0 * S + k0[:, None] * u0[None, :]
        o0 = _rsum(q0[:, None] * S_root, axis=0) * scale
        m_root = m_v & (o_v * 0 + missing == 0)  # (a vector test: the interpreter mishandles bool-scalar masks)
        tl.store(u_base + o_v, u0, mask=m_root)
        tl.store(o_base + o_v, o0.to(o.dtype.element_ty), mask=m_root)
        tl.store(gm_base, g0, mask=rooted)
        S = tl.where(rooted, S_root, S)
        R0 = rooted.to(tl.int32)
        g_root = tl.where(rooted, g0, 0.0)

    for i in range(0, (T - R0 + BT - 1) // BT):
        r0 = R0 + i * BT
        t_r = r0 + o_r
        m_r = t_r < T
        k_i = tl.load(k_base + t_r[:, None] * sk_t + o_k[None, :], mask=m_r[:, None] & m_kv, other=0.0)
        q_i = tl.load(q_base + t_r[:, None] * sq_t + o_k[None, :], mask=m_r[:, None] & m_kv, other=0.0)
        v_i = tl.load(v_base + t_r[:, None] * sv_t + o_v[None, :], mask=m_r[:, None] & m_vv, other=0.0)
        b_i = tl.load(b_base + t_r * sb_t, mask=m_r, other=0.0)
        M_i = tl.load(tmask + t_r[:, None] * T + o_n[None, :], mask=m_r[:, None] & m_n[None, :], other=0)
        if DOT_F32:
            k_i = k_i.to(tl.float32)
            q_i = q_i.to(tl.float32)
        v_i = v_i.to(tl.float32)
        b_i = b_i.to(tl.float32)
        if RAW_GATES:  # β = sigmoid(b) in b's dtype, as the module computes it
            b_i = tl.where(m_r, _beta(b_i, beta.dtype.element_ty), 0.0)

        # Γ of this block's rows (path sums: ancestor-mask row · g). Every program writes the same values to
        # `gamma`; later blocks read earlier rows back from there (after the barrier at the loop end).
        G_i = _rsum(tl.where(M_i != 0, g_all[None, :], 0.0), axis=1)
        tl.store(gm_base + t_r * HV, G_i, mask=m_r)
        eG = tl.exp(G_i - g_root)

        kS = tl.dot(k_i.to(tl.float32), S, input_precision=DOT_PREC)  # [BT, BV]
        qS = tl.dot(q_i.to(tl.float32), S, input_precision=DOT_PREC)
        if L2NORM:
            kf_i = k_i.to(tl.float32)
            qf_i = q_i.to(tl.float32)
            rk_i = tl.rsqrt(_rsum(kf_i * kf_i, axis=1) + 1e-6)
            rq_i = tl.rsqrt(_rsum(qf_i * qf_i, axis=1) + 1e-6)
            kS = kS * rk_i[:, None]
            qS = qS * rq_i[:, None]
        rhs = b_i[:, None] * (v_i - eG[:, None] * kS)
        o_acc = eG[:, None] * qS

        # ancestors in earlier blocks, BC columns at a time: rhs -= A[i, <r0] U[<r0]; o += (QKᵀ⊙D)[i, <r0] U[<r0]
        for c in range(0, (r0 - R0 + BC - 1) // BC):
            t_c = R0 + c * BC + o_c
            m_c = t_c < r0
            KT_c = tl.load(k_base + t_c[None, :] * sk_t + o_k[:, None], mask=m_c[None, :] & m_k[:, None], other=0.0)
            if DOT_F32:
                KT_c = KT_c.to(tl.float32)
            G_c = tl.load(gm_base + t_c * HV, mask=m_c, other=0.0)
            M_c = tl.load(tmask + t_r[:, None] * T + t_c[None, :], mask=m_r[:, None] & m_c[None, :], other=0) != 0
            D_c = tl.exp(tl.where(M_c, G_i[:, None] - G_c[None, :], float("-inf")))
            if L2NORM:
                kf_c = KT_c.to(tl.float32)
                rk_c = tl.rsqrt(_rsum(kf_c * kf_c, axis=0) + 1e-6)
                D_c = D_c * rk_c[None, :]
            U_c = tl.load(u_base + t_c[:, None] * (HV * V) + o_v[None, :], mask=m_c[:, None] & m_vv, other=0.0)
            kk = tl.dot(k_i, KT_c, input_precision=DOT_PREC)  # [BT, BC]
            if L2NORM:
                kk = kk * rk_i[:, None]
            rhs -= tl.dot(kk * D_c * b_i[:, None], U_c, input_precision=DOT_PREC)
            qk = tl.dot(q_i, KT_c, input_precision=DOT_PREC)
            if L2NORM:
                qk = qk * rq_i[:, None]
            o_acc += tl.dot(qk * D_c, U_c, input_precision=DOT_PREC)

        # diagonal block: ancestors inside the block (strict for A, inclusive for the output)
        M_d = tl.load(tmask + t_r[:, None] * T + t_r[None, :], mask=m_r[:, None] & m_r[None, :], other=0) != 0
        D_d = tl.exp(tl.where(M_d, G_i[:, None] - G_i[None, :], float("-inf")))
        kT_i = tl.trans(k_i)
        kk_d = tl.dot(k_i, kT_i, input_precision=DOT_PREC)  # [BT, BT]
        qk_d = tl.dot(q_i, kT_i, input_precision=DOT_PREC)
        if L2NORM:
            kk_d = kk_d * rk_i[:, None] * rk_i[None, :]
            qk_d = qk_d * rq_i[:, None] * rk_i[None, :]
        P = _block_inverse(kk_d, D_d, b_i, BT, LOG2_BT, INV_PREC)
        U_i = tl.dot(P, rhs, input_precision=INV_PREC)
        tl.store(u_base + t_r[:, None] * (HV * V) + o_v[None, :], U_i, mask=m_r[:, None] & m_vv)

        o_acc += tl.dot(qk_d * D_d, U_i, input_precision=DOT_PREC)
        tl.store(o_base + t_r[:, None] * (HV * V) + o_v[None, :], (o_acc * scale).to(o.dtype.element_ty),
                 mask=m_r[:, None] & m_vv)
        # this program's u rows (and gamma rows) are read back by later blocks: order the stores first
        tl.debug_barrier()


_gdn_tree_verify_autotuned = triton.autotune(
    configs=_VERIFY_CANDIDATES if not _INTERPRET else _VERIFY_CONFIGS,
    key=["TP", "K", "V", "H", "HV", "L2NORM", "DOT_PREC", "DOT_F32", "INV_PREC", "PEEL"],
)(_gdn_tree_verify_kernel)


# ----------------------------------------------------------------------------------------------------------------
# Resident verify: the same math, right-looking, with the right-hand side of every row held in registers.
#   1. prep   (grid blocks × B·HV, parallel): Γ of every node, and each row block's diagonal inverse
#             P_i = (I + A_ii)^{-1} ([B, HV, T, BT] scratch, fp32).
#   2. verify (grid V/BV × B·HV): R = β ⊙ (V − e^Γ ⊙ K S0) for all T rows at once ([T_pad, BV] registers); then per
#             row block i: U_i = P_i R_i (one dot against R with P_i placed at block i's columns, so no row
#             extraction), R −= A[:, i] U_i for the rows below the block, O += (Q Kᵀ ⊙ D)[:, i] U_i.
# The serial chain per block is two dependent dots in registers: nothing of U is stored and read back (u is only
# written, for the commit), so there is no barrier, and the U-independent loads (K_i, mask columns, P_i) do not wait
# on the solve (one pipeline stage: two measured slower). The price: K and Q of all T rows stay resident ([T_pad, K]
# each), so T_pad ≤ 128 (RESIDENT_MAX_NODES). Measured on the H200 (BENCHMARKS.md, "Session 10: the resident
# verify"): at T = 64 23.2-24.2 µs against the fused kernel's 26.8-27.3; slower at T ≤ 32 (the prep launch costs
# more than 1-2 serial blocks save) and at T_pad = 128 (129 µs against 60; the fp32 P_i·R product over all 128 rows
# is much of it: 68 µs with it in tf32x3). So impl=None takes it for RESIDENT_NODES only.
# ----------------------------------------------------------------------------------------------------------------
RESIDENT_MAX_NODES = 128
RESIDENT_NODES = range(49, 65)  # four row blocks, T_pad = 64: the measured case
if _INTERPRET:
    _RESIDENT_CONFIGS = [triton.Config({"BV": 16}, num_warps=4, num_stages=1)]
else:
    _RESIDENT_CONFIGS = [triton.Config({"BV": 32}, num_warps=4, num_stages=1)]


@triton.jit
def _resident_prep_kernel(
    k, g, beta, tmask, pinv, gamma, a_log, dt_bias,
    T,
    sk_b, sk_t, sk_h,
    sg_b, sg_t, sg_h,
    sb_b, sb_t, sb_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    TP: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, LOG2_BT: tl.constexpr,
    L2NORM: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, INV_PREC: tl.constexpr,
    RAW_GATES: tl.constexpr,
):
    i_blk = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b64 = (i_bh // HV).to(tl.int64)
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_n = tl.arange(0, TP)
    m_n = o_n < T
    o_r = tl.arange(0, BT)
    t_r = i_blk * BT + o_r
    m_r = t_r < T

    g_all = tl.load(g + i_b64 * sg_b + i_hv * sg_h + o_n * sg_t, mask=m_n, other=0.0).to(tl.float32)
    if RAW_GATES:
        g_all = tl.where(m_n, _decay(g_all, a_log, dt_bias, i_hv), 0.0)
    M_i = tl.load(tmask + t_r[:, None] * T + o_n[None, :], mask=m_r[:, None] & m_n[None, :], other=0) != 0
    G_i = _rsum(tl.where(M_i, g_all[None, :], 0.0), axis=1)
    tl.store(gamma + i_b64 * T * HV + i_hv + t_r * HV, G_i, mask=m_r)

    k_i = tl.load(k + i_b64 * sk_b + i_h * sk_h + t_r[:, None] * sk_t + o_k[None, :],
                  mask=m_r[:, None] & m_k[None, :], other=0.0)
    if DOT_F32:
        k_i = k_i.to(tl.float32)
    b_i = tl.load(beta + i_b64 * sb_b + i_hv * sb_h + t_r * sb_t, mask=m_r, other=0.0).to(tl.float32)
    if RAW_GATES:
        b_i = tl.where(m_r, _beta(b_i, beta.dtype.element_ty), 0.0)
    kk_d = tl.dot(k_i, tl.trans(k_i), input_precision=DOT_PREC)
    if L2NORM:
        kf_i = k_i.to(tl.float32)
        rk_i = tl.rsqrt(_rsum(kf_i * kf_i, axis=1) + 1e-6)
        kk_d = kk_d * rk_i[:, None] * rk_i[None, :]
    M_d = tl.load(tmask + t_r[:, None] * T + t_r[None, :], mask=m_r[:, None] & m_r[None, :], other=0) != 0
    D_d = tl.exp(tl.where(M_d, G_i[:, None] - G_i[None, :], float("-inf")))
    P = _block_inverse(kk_d, D_d, b_i, BT, LOG2_BT, INV_PREC)
    tl.store(pinv + (i_b64 * HV + i_hv) * T * BT + t_r[:, None] * BT + o_r[None, :], P, mask=m_r[:, None])


@triton.jit
def _resident_verify_kernel(
    q, k, v, beta, s0, tmask, pinv, gamma, o, u,
    T, scale,
    sq_b, sq_t, sq_h,
    sk_b, sk_t, sk_h,
    sv_b, sv_t, sv_h,
    sb_b, sb_t, sb_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    TP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    L2NORM: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, INV_PREC: tl.constexpr,
    RAW_GATES: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b64 = (i_bh // HV).to(tl.int64)
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_n = tl.arange(0, TP)
    m_n = o_n < T
    o_r = tl.arange(0, BT)

    k_base = k + i_b64 * sk_b + i_h * sk_h
    o_base = o + i_b64 * T * HV * V + i_hv * V
    u_base = u + i_b64 * T * HV * V + i_hv * V
    gm_base = gamma + i_b64 * T * HV + i_hv
    p_base = pinv + (i_b64 * HV + i_hv) * T * BT

    # every row at once: R = β (V − e^Γ K S0), O = e^Γ Q S0 (row norms applied as scalings of the raw dots)
    m_nk = m_n[:, None] & m_k[None, :]
    K_all = tl.load(k_base + o_n[:, None] * sk_t + o_k[None, :], mask=m_nk, other=0.0)
    Q_all = tl.load(q + i_b64 * sq_b + i_h * sq_h + o_n[:, None] * sq_t + o_k[None, :], mask=m_nk, other=0.0)
    if DOT_F32:
        K_all = K_all.to(tl.float32)
        Q_all = Q_all.to(tl.float32)
    V_all = tl.load(v + i_b64 * sv_b + i_hv * sv_h + o_n[:, None] * sv_t + o_v[None, :],
                    mask=m_n[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    b_all = tl.load(beta + i_b64 * sb_b + i_hv * sb_h + o_n * sb_t, mask=m_n, other=0.0).to(tl.float32)
    if RAW_GATES:
        b_all = tl.where(m_n, _beta(b_all, beta.dtype.element_ty), 0.0)
    G_all = tl.load(gm_base + o_n * HV, mask=m_n, other=0.0)
    S = tl.load(s0 + (i_b64 * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :],
                mask=m_k[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    kS = tl.dot(K_all.to(tl.float32), S, input_precision=DOT_PREC)
    qS = tl.dot(Q_all.to(tl.float32), S, input_precision=DOT_PREC)
    if L2NORM:
        kf = K_all.to(tl.float32)
        qf = Q_all.to(tl.float32)
        rk_all = tl.rsqrt(_rsum(kf * kf, axis=1) + 1e-6)
        rq_all = tl.rsqrt(_rsum(qf * qf, axis=1) + 1e-6)
        kS = kS * rk_all[:, None]
        qS = qS * rq_all[:, None]
    eG = tl.exp(G_all)
    R = b_all[:, None] * (V_all - eG[:, None] * kS)
    o_acc = eG[:, None] * qS

    for i in range(0, (T + BT - 1) // BT):
        r0 = i * BT
        t_c = r0 + o_r
        m_c = t_c < T
        # U-independent operands of this block's column (decays, A and Q Kᵀ ⊙ D columns, P_i): none waits on the solve
        G_c = tl.load(gm_base + t_c * HV, mask=m_c, other=0.0)
        M_col = tl.load(tmask + o_n[:, None] * T + t_c[None, :], mask=m_n[:, None] & m_c[None, :], other=0) != 0
        D_col = tl.exp(tl.where(M_col, G_all[:, None] - G_c[None, :], float("-inf")))
        KT_i = tl.load(k_base + t_c[None, :] * sk_t + o_k[:, None], mask=m_c[None, :] & m_k[:, None], other=0.0)
        if DOT_F32:
            KT_i = KT_i.to(tl.float32)
        if L2NORM:
            kf_c = KT_i.to(tl.float32)
            D_col = D_col * tl.rsqrt(_rsum(kf_c * kf_c, axis=0) + 1e-6)[None, :]
        kk = tl.dot(K_all, KT_i, input_precision=DOT_PREC)  # [TP, BT]
        qk = tl.dot(Q_all, KT_i, input_precision=DOT_PREC)
        if L2NORM:
            kk = kk * rk_all[:, None]
            qk = qk * rq_all[:, None]
        A_col = tl.where((o_n >= r0 + BT)[:, None], kk * D_col * b_all[:, None], 0.0)
        QD_col = qk * D_col
        in_blk = (o_n >= r0) & (o_n < r0 + BT) & m_n
        P_i = tl.load(p_base + t_c[:, None] * BT + (o_n - r0)[None, :], mask=m_c[:, None] & in_blk[None, :],
                      other=0.0)  # [BT, TP]: P_i at block i's columns, zeros elsewhere

        U_i = tl.dot(P_i, R, input_precision=INV_PREC)  # [BT, BV]
        tl.store(u_base + t_c[:, None] * (HV * V) + o_v[None, :], U_i, mask=m_c[:, None] & m_v[None, :])
        R -= tl.dot(A_col, U_i, input_precision=DOT_PREC)
        o_acc += tl.dot(QD_col, U_i, input_precision=DOT_PREC)

    tl.store(o_base + o_n[:, None] * (HV * V) + o_v[None, :], (o_acc * scale).to(o.dtype.element_ty),
             mask=m_n[:, None] & m_v[None, :])


# ----------------------------------------------------------------------------------------------------------------
# Neumann verify: no serial chain of row blocks. N = −β ⊙ (K Kᵀ ⊙ D ⊙ M_strict) is nilpotent with N^(d+1) = 0 for a
# tree of depth d (N^m links a node only to ancestors m levels up), so (I + A)^{-1} R = Σ_{m≤d} N^m R, evaluated by
# Horner: U ← R + N U, d times (node i's row is exact after depth(i) steps). Two launches:
#   1. prep  (grid row blocks × B·HV, parallel): Γ, and the [T_pad, T_pad] coefficient matrices N and
#            C = Q Kᵀ ⊙ D ⊙ M (fp32 scratch, L2-resident), and the depth d (read off the mask: any tree is exact).
#   2. solve (grid V/BV × B·HV): R = β (V − e^Γ K S0), U by d dense [T_pad, T_pad]·[T_pad, BV] dots,
#            O = e^Γ Q S0 + C U.
# d dots instead of ⌈T/16⌉ latency-bound row blocks: it pays for shallow trees (a block drafter's trees have depth
# ≤ block size − 1 = 15) and loses on long chains (impl=None keeps those on the fused kernel). T_pad ≤ 128.
# Same math as the fused kernel's 16×16 diagonal inverse, over the whole tree.
# ----------------------------------------------------------------------------------------------------------------
NEUMANN_MAX_NODES = 128
# impl=None takes the Neumann form for trees of NEUMANN_NODES nodes (after the root step) whose caller bounds their depth
# by NEUMANN_MAX_DEPTH (``max_depth``): H200, Qwen3.6-27B shape, verify µs per layer, fused → Neumann: 64 nodes
# depth 7 26.7 → 16.3, depth 17 27.0 → 19.7; 128 nodes depth 6 60.3 → 29.9, depth 18 60.2 → 39.9; a 64-chain
# 27.0 → 40.0 (≈ 0.35 / 0.9 µs per depth step at 64 / 128 nodes: break-even near depth 38). BENCHMARKS.md.
NEUMANN_MAX_DEPTH = 31
USE_NEUMANN = True  # False: impl=None never takes it (an A/B switch for replays: diagnose_fused_steps --ab neumann)
# node counts (after the root step) where it measured or, between the measured 64 and 128, is bound to be faster:
# not 65-96 (T_pad 128 for five or six row blocks: 65 nodes without the root step 40.6 against fused 34.8) nor ≤ 48
# (≈ 14 µs of fixed cost against two or three row blocks)
NEUMANN_NODES = [*range(49, 65), *range(97, NEUMANN_MAX_NODES + 1)]
# the Horner products N·U in single-pass tf32 for 16-bit inputs: committed state 4.7-5.6e-5 rel. RMS from fp64 in
# the benchmark (the fused kernel: 3.9-5.0e-5), up to 7.8e-4 on the tests' inputs — inside the 5e-3 bf16 budget and
# under fla chunk's 3.1e-3; "tf32x3" (inverse_precision) takes it to ≤ 4e-5 at 1.3-2× the time. fp32 inputs: IEEE.
NEUMANN_PRECISION = "tf32"
_NEUMANN_PREP_ROWS = 16
# the solve's config by padded node count (None: any other); measured on the H200, BENCHMARKS.md
if _INTERPRET:
    _NEUMANN_CONFIGS = {None: triton.Config({"BV": 16}, num_warps=4, num_stages=1)}
else:
    _NEUMANN_CONFIGS = {None: triton.Config({"BV": 32}, num_warps=4, num_stages=1),
                        128: triton.Config({"BV": 64}, num_warps=8, num_stages=1)}


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _neumann_prep_kernel(
    q, k, g, beta, tmask, coef, gamma, depth, a_log, dt_bias,
    T,
    sq_b, sq_t, sq_h,
    sk_b, sk_t, sk_h,
    sg_b, sg_t, sg_h,
    sb_b, sb_t, sb_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, TP: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
    L2NORM: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, RAW_GATES: tl.constexpr,
    PEEL: tl.constexpr,
):
    # local index n is node n + PEEL: with PEEL the root is left to the solve's recurrent step, and Γ' (path sums
    # without the root) and N, C cover nodes 1..T-1 (a forest when the root is peeled; its exclusion changes no
    # difference Γ_i − Γ_j of nodes on one path)
    i_blk = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b64 = (i_bh // HV).to(tl.int64)
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_n = tl.arange(0, TP)
    m_n = o_n < T - PEEL
    t_r = i_blk * BR + tl.arange(0, BR)
    m_r = t_r < T - PEEL

    g_base = g + i_b64 * sg_b + i_hv * sg_h
    M = tl.load(tmask + (o_n[:, None] + PEEL) * T + o_n[None, :] + PEEL, mask=m_n[:, None] & m_n[None, :],
                other=0) != 0
    g_all = tl.load(g_base + (o_n + PEEL) * sg_t, mask=m_n, other=0.0).to(tl.float32)
    if RAW_GATES:
        g_all = tl.where(m_n, _decay(g_all, a_log, dt_bias, i_hv), 0.0)
    G_c = _rsum(tl.where(M, g_all[None, :], 0.0), axis=1)
    if i_blk == 0:
        gm_base = gamma + i_b64 * T * HV + i_hv
        if PEEL:
            g0 = tl.load(g_base).to(tl.float32)
            if RAW_GATES:
                g0 = _decay(g0, a_log, dt_bias, i_hv)
            tl.store(gm_base, g0)
            desc = tl.load(tmask + (o_n + 1) * T, mask=m_n, other=0) != 0
            tl.store(gm_base + (o_n + 1) * HV, G_c + tl.where(desc, g0, 0.0), mask=m_n)
        else:
            tl.store(gm_base + o_n * HV, G_c, mask=m_n)
        if i_bh == 0:
            tl.store(depth, tl.reduce(_rsum(M.to(tl.int32), axis=1), 0, _max) - 1)
    M_r = tl.load(tmask + (t_r[:, None] + PEEL) * T + o_n[None, :] + PEEL, mask=m_r[:, None] & m_n[None, :],
                  other=0) != 0
    G_r = _rsum(tl.where(M_r, g_all[None, :], 0.0), axis=1)
    D = tl.exp(tl.where(M_r, G_r[:, None] - G_c[None, :], float("-inf")))  # [BR, TP]

    k_base = k + i_b64 * sk_b + i_h * sk_h
    q_r = tl.load(q + i_b64 * sq_b + i_h * sq_h + (t_r[:, None] + PEEL) * sq_t + o_k[None, :],
                  mask=m_r[:, None] & m_k[None, :], other=0.0)
    k_r = tl.load(k_base + (t_r[:, None] + PEEL) * sk_t + o_k[None, :], mask=m_r[:, None] & m_k[None, :], other=0.0)
    KT = tl.load(k_base + (o_n[None, :] + PEEL) * sk_t + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0.0)
    if DOT_F32:
        q_r = q_r.to(tl.float32)
        k_r = k_r.to(tl.float32)
        KT = KT.to(tl.float32)
    kk = tl.dot(k_r, KT, input_precision=DOT_PREC)  # [BR, TP]
    qk = tl.dot(q_r, KT, input_precision=DOT_PREC)
    if L2NORM:
        kf = KT.to(tl.float32)
        rk_c = tl.rsqrt(_rsum(kf * kf, axis=0) + 1e-6)
        kr = k_r.to(tl.float32)
        qr = q_r.to(tl.float32)
        kk = kk * tl.rsqrt(_rsum(kr * kr, axis=1) + 1e-6)[:, None] * rk_c[None, :]
        qk = qk * tl.rsqrt(_rsum(qr * qr, axis=1) + 1e-6)[:, None] * rk_c[None, :]
    b_r = tl.load(beta + i_b64 * sb_b + i_hv * sb_h + (t_r + PEEL) * sb_t, mask=m_r, other=0.0).to(tl.float32)
    if RAW_GATES:
        b_r = tl.where(m_r, _beta(b_r, beta.dtype.element_ty), 0.0)
    strict = t_r[:, None] != o_n[None, :]
    N = tl.where(strict, -(b_r[:, None] * kk * D), 0.0)
    c_base = coef + (i_b64 * HV + i_hv) * 2 * TP * TP + t_r[:, None] * TP + o_n[None, :]
    tl.store(c_base, N)  # rows and columns past the nodes are zero (D is), so the solve needs no masks
    tl.store(c_base + TP * TP, qk * D)


@triton.jit
def _neumann_solve_kernel(
    q, k, v, g, beta, s0, tmask, coef, gamma, depth, o, u, a_log, dt_bias,
    T, scale,
    sq_b, sq_t, sq_h,
    sk_b, sk_t, sk_h,
    sv_b, sv_t, sv_h,
    sg_b, sg_t, sg_h,
    sb_b, sb_t, sb_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    TP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, SOLVE_PREC: tl.constexpr,
    RAW_GATES: tl.constexpr, PEEL: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b64 = (i_bh // HV).to(tl.int64)
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_n = tl.arange(0, TP)
    m_n = o_n < T - PEEL
    m_nk = m_n[:, None] & m_k[None, :]
    m_nv = m_n[:, None] & m_v[None, :]
    t_n = o_n + PEEL  # node of local row n

    q_base = q + i_b64 * sq_b + i_h * sq_h
    k_base = k + i_b64 * sk_b + i_h * sk_h
    v_base = v + i_b64 * sv_b + i_hv * sv_h
    b_base = beta + i_b64 * sb_b + i_hv * sb_h
    o_base = o + i_b64 * T * HV * V + i_hv * V
    u_base = u + i_b64 * T * HV * V + i_hv * V

    d_max = tl.load(depth)
    G = tl.load(gamma + i_b64 * T * HV + i_hv + t_n * HV, mask=m_n, other=0.0)
    b_all = tl.load(b_base + t_n * sb_t, mask=m_n, other=0.0).to(tl.float32)
    if RAW_GATES:
        b_all = tl.where(m_n, _beta(b_all, beta.dtype.element_ty), 0.0)
    K_all = tl.load(k_base + t_n[:, None] * sk_t + o_k[None, :], mask=m_nk, other=0.0).to(tl.float32)
    Q_all = tl.load(q_base + t_n[:, None] * sq_t + o_k[None, :], mask=m_nk, other=0.0).to(tl.float32)
    v_all = tl.load(v_base + t_n[:, None] * sv_t + o_v[None, :], mask=m_nv, other=0.0).to(tl.float32)
    S = tl.load(s0 + (i_b64 * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :],
                mask=m_k[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    kS = tl.dot(K_all, S, input_precision=DOT_PREC)  # [TP, BV]
    qS = tl.dot(Q_all, S, input_precision=DOT_PREC)
    if PEEL:
        # the root as one recurrent step, S1 = e^{g0} S0 + k0 u0ᵀ, folded into the rows that descend from it:
        # K S1 = e^{g0} K S0 + (K k0) u0ᵀ (likewise Q); their decays from S1 are e^{Γ − g0}
        g0 = tl.load(g + i_b64 * sg_b + i_hv * sg_h).to(tl.float32)
        if RAW_GATES:
            g0 = _decay(g0, a_log, dt_bias, i_hv)
        q0, k0, e0, u0 = _root_step(q_base, k_base, v_base, b_base, o_k, m_k, o_v, m_v, S, g0,
                                    beta.dtype.element_ty, L2NORM, RAW_GATES)
        o0 = e0 * _rsum(q0[:, None] * S, axis=0) + _rsum(q0 * k0, axis=0) * u0
        tl.store(u_base + o_v, u0, mask=m_v)
        tl.store(o_base + o_v, (o0 * scale).to(o.dtype.element_ty), mask=m_v)
        desc = tl.load(tmask + t_n * T, mask=m_n, other=0) != 0
        kS = tl.where(desc[:, None], e0 * kS + _rsum(K_all * k0[None, :], axis=1)[:, None] * u0[None, :], kS)
        qS = tl.where(desc[:, None], e0 * qS + _rsum(Q_all * k0[None, :], axis=1)[:, None] * u0[None, :], qS)
        G = G - tl.where(desc, g0, 0.0)
    if L2NORM:
        kS = kS * tl.rsqrt(_rsum(K_all * K_all, axis=1) + 1e-6)[:, None]
        qS = qS * tl.rsqrt(_rsum(Q_all * Q_all, axis=1) + 1e-6)[:, None]
    eG = tl.exp(G)
    R = b_all[:, None] * (v_all - eG[:, None] * kS)

    c_base = coef + (i_b64 * HV + i_hv) * 2 * TP * TP + o_n[:, None] * TP + o_n[None, :]
    N = tl.load(c_base)
    U = R
    for _ in range(0, d_max):  # U = Σ_{m ≤ depth} N^m R
        U = R + tl.dot(N, U, input_precision=SOLVE_PREC)
    tl.store(u_base + t_n[:, None] * (HV * V) + o_v[None, :], U, mask=m_nv)
    C = tl.load(c_base + TP * TP)
    o_acc = eG[:, None] * qS + tl.dot(C, U, input_precision=DOT_PREC)
    tl.store(o_base + t_n[:, None] * (HV * V) + o_v[None, :], (o_acc * scale).to(o.dtype.element_ty), mask=m_nv)


def _verify_neumann(args, common, raw, precision, BV, num_warps, peel):
    (q, k, v, g, beta, s0, mask, o, u, gamma, a_log, dt_bias, T, scale, *strides) = args
    sq, sk, sv, sg, sb = (strides[i:i + 3] for i in range(0, 15, 3))
    B, _, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    TP = max(16, next_pow2(T - peel))
    coef = torch.empty((B, HV, 2, TP, TP), dtype=torch.float32, device=u.device)
    depth = torch.empty((1,), dtype=torch.int32, device=u.device)
    c = {n: common[n] for n in ("H", "HV", "K", "BK", "L2NORM", "DOT_PREC", "DOT_F32")}
    if BV is None:
        cfg = _NEUMANN_CONFIGS.get(TP, _NEUMANN_CONFIGS[None])
        BV, num_warps = cfg.kwargs["BV"], cfg.num_warps
    with launch_ctx(_INTERPRET):
        _neumann_prep_kernel[(TP // _NEUMANN_PREP_ROWS, B * HV)](
            q, k, g, beta, mask, coef, gamma, depth, a_log, dt_bias, T, *sq, *sk, *sg, *sb, **c, TP=TP,
            BR=_NEUMANN_PREP_ROWS, RAW_GATES=raw, PEEL=peel, num_warps=4, num_stages=1,
        )
        _neumann_solve_kernel[(triton.cdiv(V, BV), B * HV)](
            q, k, v, g, beta, s0, mask, coef, gamma, depth, o, u, a_log, dt_bias, T, scale, *sq, *sk, *sv, *sg, *sb,
            **c, V=V, TP=TP, BV=BV, SOLVE_PREC=precision, RAW_GATES=raw, PEEL=peel, num_warps=num_warps,
            num_stages=1,
        )


# ----------------------------------------------------------------------------------------------------------------
# Split verify: the same math in three launches, so that only the truly serial part stays serial.
#   1. local  (grid V/BV × blocks × B·HV, fully parallel): Γ, W_i = (I + A_ii)^{-1} β_i (v_i − e^{Γ_i} k_i S0) and
#             L_i = (I + A_ii)^{-1} A_{i,<i} (written once per head) — every inverse and every K Kᵀ product.
#   2. solve  (grid V/BV × B·HV, serial over row blocks): U_i = W_i − L_i U_{<i}: one [16, T]·[T, BV] dot a step.
#   3. output (grid V/BV × blocks × B·HV, fully parallel): O_i = scale (e^{Γ_i} q_i S0 + (q_i Kᵀ ⊙ D)_{i, ≤i} U).
# Scratch: W [B, T, HV, V] and L [B, HV, T, T] (fp32, L2-resident at these sizes).
# Measured on the H200 it is *slower* than the fused kernel at every T ≤ 128 (three launches, and the serial solve
# steps cost about as much as a fused row block: both are latency-bound chains of small dependent operations), so it
# is not the default (SPLIT_MIN_NODES); kept, tested, for larger batches/heads where parallelism is not the issue.
# ----------------------------------------------------------------------------------------------------------------
if _INTERPRET:
    _LOCAL_CONFIGS = [triton.Config({"BV": 16}, num_warps=4, num_stages=1)]
    _SOLVE_CONFIGS = [triton.Config({"BV": 16}, num_warps=4, num_stages=1)]
    _OUTPUT_CONFIGS = [triton.Config({"BV": 16}, num_warps=4, num_stages=1)]
else:
    _LOCAL_CONFIGS = [triton.Config({"BV": 32}, num_warps=4, num_stages=1),
                      triton.Config({"BV": 64}, num_warps=8, num_stages=1)]
    # solve re-reads rows of u it stored in an earlier step: no software pipelining (num_stages=1)
    _SOLVE_CONFIGS = [triton.Config({"BV": bv}, num_warps=4, num_stages=1) for bv in (16, 32)]
    _OUTPUT_CONFIGS = [triton.Config({"BV": 32}, num_warps=4, num_stages=1),
                       triton.Config({"BV": 64}, num_warps=8, num_stages=1)]


@triton.jit
def _split_local_kernel(
    k, v, g, beta, s0, tmask, w, lbuf, gamma,
    T,
    sk_b, sk_t, sk_h,
    sv_b, sv_t, sv_h,
    sg_b, sg_t, sg_h,
    sb_b, sb_t, sb_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    TP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, LOG2_BT: tl.constexpr,
    BC: tl.constexpr, L2NORM: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_blk = tl.program_id(1)
    i_bh = tl.program_id(2)
    i_b = i_bh // HV
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    i_b64 = i_b.to(tl.int64)

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_n = tl.arange(0, TP)
    m_n = o_n < T
    o_r = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    r0 = i_blk * BT
    t_r = r0 + o_r
    m_r = t_r < T

    k_base = k + i_b64 * sk_b + i_h * sk_h
    g_all = tl.load(g + i_b64 * sg_b + i_hv * sg_h + o_n * sg_t, mask=m_n, other=0.0).to(tl.float32)
    k_i = tl.load(k_base + t_r[:, None] * sk_t + o_k[None, :], mask=m_r[:, None] & m_k[None, :], other=0.0)
    if DOT_F32:
        k_i = k_i.to(tl.float32)
    v_i = tl.load(v + i_b64 * sv_b + i_hv * sv_h + t_r[:, None] * sv_t + o_v[None, :],
                  mask=m_r[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    b_i = tl.load(beta + i_b64 * sb_b + i_hv * sb_h + t_r * sb_t, mask=m_r, other=0.0).to(tl.float32)
    S = tl.load(s0 + (i_b64 * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :],
                mask=m_k[:, None] & m_v[None, :], other=0.0).to(tl.float32)

    M_i = tl.load(tmask + t_r[:, None] * T + o_n[None, :], mask=m_r[:, None] & m_n[None, :], other=0) != 0
    G_i = _rsum(tl.where(M_i, g_all[None, :], 0.0), axis=1)
    if i_v == 0:
        tl.store(gamma + i_b64 * T * HV + i_hv + t_r * HV, G_i, mask=m_r)
    eG = tl.exp(G_i)

    kS = tl.dot(k_i.to(tl.float32), S, input_precision=DOT_PREC)
    kT_i = tl.trans(k_i)
    kk_d = tl.dot(k_i, kT_i, input_precision=DOT_PREC)
    if L2NORM:
        kf_i = k_i.to(tl.float32)
        rk_i = tl.rsqrt(_rsum(kf_i * kf_i, axis=1) + 1e-6)
        kS = kS * rk_i[:, None]
        kk_d = kk_d * rk_i[:, None] * rk_i[None, :]
    rhs = b_i[:, None] * (v_i - eG[:, None] * kS)

    M_d = tl.load(tmask + t_r[:, None] * T + t_r[None, :], mask=m_r[:, None] & m_r[None, :], other=0) != 0
    D_d = tl.exp(tl.where(M_d, G_i[:, None] - G_i[None, :], float("-inf")))
    P = _block_inverse(kk_d, D_d, b_i, BT, LOG2_BT, "ieee")
    W_i = tl.dot(P, rhs, input_precision="ieee")
    tl.store(w + i_b64 * T * HV * V + i_hv * V + t_r[:, None] * (HV * V) + o_v[None, :], W_i,
             mask=m_r[:, None] & m_v[None, :])

    if i_v == 0:
        l_base = lbuf + (i_b64 * HV + i_hv) * T * T
        for c in range(0, (r0 + BC - 1) // BC):
            t_c = c * BC + o_c
            m_c = t_c < r0
            KT_c = tl.load(k_base + t_c[None, :] * sk_t + o_k[:, None], mask=m_c[None, :] & m_k[:, None], other=0.0)
            if DOT_F32:
                KT_c = KT_c.to(tl.float32)
            M_cc = tl.load(tmask + t_c[:, None] * T + o_n[None, :], mask=m_c[:, None] & m_n[None, :], other=0) != 0
            G_c = _rsum(tl.where(M_cc, g_all[None, :], 0.0), axis=1)
            M_c = tl.load(tmask + t_r[:, None] * T + t_c[None, :], mask=m_r[:, None] & m_c[None, :], other=0) != 0
            D_c = tl.exp(tl.where(M_c, G_i[:, None] - G_c[None, :], float("-inf")))
            kk = tl.dot(k_i, KT_c, input_precision=DOT_PREC)
            if L2NORM:
                kf_c = KT_c.to(tl.float32)
                rk_c = tl.rsqrt(_rsum(kf_c * kf_c, axis=0) + 1e-6)
                kk = kk * rk_i[:, None] * rk_c[None, :]
            L_c = tl.dot(P, kk * D_c * b_i[:, None], input_precision="ieee")
            tl.store(l_base + t_r[:, None] * T + t_c[None, :], L_c, mask=m_r[:, None] & m_c[None, :])


@triton.jit
def _split_solve_kernel(
    w, lbuf, u, T,
    HV: tl.constexpr, V: tl.constexpr, TP: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b64 = (i_bh // HV).to(tl.int64)
    i_hv = i_bh % HV
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_n = tl.arange(0, TP)
    o_r = tl.arange(0, BT)
    w_base = w + i_b64 * T * HV * V + i_hv * V
    u_base = u + i_b64 * T * HV * V + i_hv * V
    l_base = lbuf + (i_b64 * HV + i_hv) * T * T
    for i in range(0, (T + BT - 1) // BT):
        r0 = i * BT
        t_r = r0 + o_r
        m_r = t_r < T
        W_i = tl.load(w_base + t_r[:, None] * (HV * V) + o_v[None, :], mask=m_r[:, None] & m_v[None, :], other=0.0)
        L_i = tl.load(l_base + t_r[:, None] * T + o_n[None, :], mask=m_r[:, None] & (o_n < r0)[None, :], other=0.0)
        U_prev = tl.load(u_base + o_n[:, None] * (HV * V) + o_v[None, :], mask=(o_n < r0)[:, None] & m_v[None, :],
                         other=0.0)
        U_i = W_i - tl.dot(L_i, U_prev, input_precision=DOT_PREC)
        tl.store(u_base + t_r[:, None] * (HV * V) + o_v[None, :], U_i, mask=m_r[:, None] & m_v[None, :])
        tl.debug_barrier()  # the next step reads these rows back


@triton.jit
def _split_output_kernel(
    q, k, s0, tmask, u, gamma, o,
    T, scale,
    sq_b, sq_t, sq_h,
    sk_b, sk_t, sk_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    TP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    L2NORM: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
):
    # TP (padded node count) is unused in the body; it keys the autotuner
    i_v = tl.program_id(0)
    i_blk = tl.program_id(1)
    i_bh = tl.program_id(2)
    i_b = i_bh // HV
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    i_b64 = i_b.to(tl.int64)

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_r = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    r0 = i_blk * BT
    t_r = r0 + o_r
    m_r = t_r < T
    r1 = r0 + BT

    k_base = k + i_b64 * sk_b + i_h * sk_h
    u_base = u + i_b64 * T * HV * V + i_hv * V
    gm_base = gamma + i_b64 * T * HV + i_hv
    q_i = tl.load(q + i_b64 * sq_b + i_h * sq_h + t_r[:, None] * sq_t + o_k[None, :],
                  mask=m_r[:, None] & m_k[None, :], other=0.0)
    if DOT_F32:
        q_i = q_i.to(tl.float32)
    S = tl.load(s0 + (i_b64 * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :],
                mask=m_k[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    G_i = tl.load(gm_base + t_r * HV, mask=m_r, other=0.0)
    qS = tl.dot(q_i.to(tl.float32), S, input_precision=DOT_PREC)
    if L2NORM:
        qf_i = q_i.to(tl.float32)
        rq_i = tl.rsqrt(_rsum(qf_i * qf_i, axis=1) + 1e-6)
        qS = qS * rq_i[:, None]
    o_acc = tl.exp(G_i)[:, None] * qS
    for c in range(0, (r1 + BC - 1) // BC):
        t_c = c * BC + o_c
        m_c = (t_c < r1) & (t_c < T)
        KT_c = tl.load(k_base + t_c[None, :] * sk_t + o_k[:, None], mask=m_c[None, :] & m_k[:, None], other=0.0)
        if DOT_F32:
            KT_c = KT_c.to(tl.float32)
        G_c = tl.load(gm_base + t_c * HV, mask=m_c, other=0.0)
        M_c = tl.load(tmask + t_r[:, None] * T + t_c[None, :], mask=m_r[:, None] & m_c[None, :], other=0) != 0
        D_c = tl.exp(tl.where(M_c, G_i[:, None] - G_c[None, :], float("-inf")))
        qk = tl.dot(q_i, KT_c, input_precision=DOT_PREC)
        if L2NORM:
            kf_c = KT_c.to(tl.float32)
            rk_c = tl.rsqrt(_rsum(kf_c * kf_c, axis=0) + 1e-6)
            qk = qk * rq_i[:, None] * rk_c[None, :]
        U_c = tl.load(u_base + t_c[:, None] * (HV * V) + o_v[None, :], mask=m_c[:, None] & m_v[None, :], other=0.0)
        o_acc += tl.dot(qk * D_c, U_c, input_precision=DOT_PREC)
    tl.store(o + i_b64 * T * HV * V + i_hv * V + t_r[:, None] * (HV * V) + o_v[None, :],
             (o_acc * scale).to(o.dtype.element_ty), mask=m_r[:, None] & m_v[None, :])


_LOCAL_KEY = ["TP", "K", "V", "H", "HV", "L2NORM", "DOT_PREC", "DOT_F32"]
_split_local_autotuned = triton.autotune(configs=_LOCAL_CONFIGS, key=_LOCAL_KEY)(_split_local_kernel)
_split_solve_autotuned = triton.autotune(configs=_SOLVE_CONFIGS, key=["TP", "V", "HV", "DOT_PREC"])(_split_solve_kernel)
_split_output_autotuned = triton.autotune(
    configs=_OUTPUT_CONFIGS, key=["TP", "K", "V", "H", "HV", "BC", "L2NORM", "DOT_PREC", "DOT_F32"]
)(_split_output_kernel)


@triton.jit
def _gdn_tree_commit_kernel(
    state, k, u, gamma, path, L, T,
    sk_b, sk_t, sk_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    LP: tl.constexpr, BK: tl.constexpr, BKF: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
    CH: tl.constexpr, PREC: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_k = tl.program_id(2)  # state rows i_k*BK.. (BK < BKF: the state split over K as well)
    i_b = i_bh // HV
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    i_b64 = i_b.to(tl.int64)

    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    o_kf = tl.arange(0, BKF)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_l = tl.arange(0, LP)

    p = tl.load(path + o_l, mask=o_l < L, other=-1).to(tl.int32)
    valid = p >= 0
    n = _rsum(valid.to(tl.int32), axis=0)
    leaf = _rsum(tl.where(o_l == n - 1, p, 0), axis=0)
    gm_base = gamma + i_b64 * T * HV + i_hv
    G_leaf = tl.load(gm_base + leaf * HV, mask=n > 0, other=0.0)

    s_ptr = state + (i_b64 * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    S = tl.load(s_ptr, mask=m_s, other=0.0).to(tl.float32)  # issued early: its latency hides under the path loop

    # Σ_j coef_j k_j u_jᵀ over the path, CH entries at a time (bounded registers for long chains; each chunk is a
    # chain of dependent loads, path → γ, k, u, so fewer, larger chunks cost less latency)
    o_c = tl.arange(0, CH)
    k_base = k + i_b64 * sk_b + i_h * sk_h
    u_base = u + i_b64 * T * HV * V + i_hv * V
    delta = tl.full([BK, BV], 0.0, tl.float32)
    for c in range(0, (n + CH - 1) // CH):
        j = c * CH + o_c
        pj = tl.load(path + j, mask=j < n, other=-1).to(tl.int32)
        vj = pj >= 0
        pj = tl.where(vj, pj, 0)
        G_j = tl.load(gm_base + pj * HV, mask=vj, other=0.0)
        cj = tl.where(vj, tl.exp(tl.where(vj, G_leaf - G_j, 0.0)), 0.0)
        kj = tl.load(k_base + pj[:, None] * sk_t + o_k[None, :], mask=vj[:, None] & m_k[None, :], other=0.0)
        kj = kj.to(tl.float32)
        if L2NORM:
            if BK < BKF:  # the norm needs the whole row
                kf = tl.load(k_base + pj[:, None] * sk_t + o_kf[None, :], mask=vj[:, None] & (o_kf < K)[None, :],
                             other=0.0).to(tl.float32)
                cj = cj * tl.rsqrt(_rsum(kf * kf, axis=1) + 1e-6)
            else:
                cj = cj * tl.rsqrt(_rsum(kj * kj, axis=1) + 1e-6)
        uj = tl.load(u_base + pj[:, None] * (HV * V) + o_v[None, :], mask=vj[:, None] & m_v[None, :], other=0.0)
        delta += tl.dot(tl.trans(kj * cj[:, None]), uj, input_precision=PREC)  # [BK, BV]

    S = tl.exp(G_leaf) * S + delta
    tl.store(s_ptr, S.to(state.dtype.element_ty), mask=m_s)


def _check_precision(precision: str) -> None:
    if precision not in ("ieee", "tf32x3", "tf32"):
        raise ValueError(f"precision must be 'ieee', 'tf32x3' or 'tf32', got {precision!r}")


def _last_contig(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def gdn_tree_verify_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    impl: str | None = None,
    BV: int | None = None,
    num_warps: int = 4,
    autotune: bool = False,
    BC: int | None = None,
    BT: int = 16,
    inverse_precision: str | None = None,
    o: torch.Tensor | None = None,
    u: torch.Tensor | None = None,
    gamma: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    peel_root: bool = False,
    max_depth: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of :func:`~weaver_kernels.gdn_tree.naive.gdn_tree_verify_ref` (same shapes and outputs).

    ``impl``: ``"fused"`` (one launch, serial over 16-row blocks), ``"split"`` (three launches, only U's block
    recurrence serial), ``"resident"`` (two launches, right-looking with every row's right-hand side in registers;
    ≤ ``RESIDENT_MAX_NODES`` nodes), ``"neumann"`` (two launches, no row blocks: ``depth`` dense Horner steps;
    ≤ ``NEUMANN_MAX_NODES`` nodes, one more with ``peel_root``) or None: Neumann for ``NEUMANN_NODES`` nodes (after
    the root step) when ``max_depth`` — a bound on the tree's depth that the caller knows, e.g. a block drafter's
    block size − 1 — is at most ``NEUMANN_MAX_DEPTH``, else by T: resident for ``RESIDENT_NODES``, else fused (see
    also ``SPLIT_MIN_NODES``). ``max_depth`` only picks the form: every form solves any tree exactly (``tree_mask`` is the
    ancestor-or-self mask, transitively closed: the Neumann form reads the depth off its row counts). ``BV``/``num_warps`` pin a config (tests,
    benchmarks; for ``"split"`` BV applies to all three kernels); by default the fused kernel launches directly with
    its measured config (``_VERIFY_CONFIGS``, no autotuner in the launch path), ``autotune=True`` sweeps
    ``_VERIFY_CANDIDATES`` with Triton's autotuner instead. ``BC`` (columns per inner
    step, default min(T_pad, 64)) is exposed for tests. ``BT``: rows per serial block of the fused kernel (16, 32 or
    64; fewer, larger blocks shorten the serial chain at the cost of a larger diagonal inverse). ``inverse_precision``: of
    the fused kernel's diagonal inverse and solve dots (``"ieee"``: fp32 FMAs; ``"tf32x3"``: fp32-accurate on tensor
    cores; ``"tf32"``); of the Neumann form's Horner products (default ``NEUMANN_PRECISION`` for 16-bit inputs,
    ``"ieee"`` for fp32 ones). ``o``/``u``/``gamma`` may be given as preallocated
    contiguous outputs (static buffers for CUDA graphs; poisoned buffers in tests). With ``A_log`` and ``dt_bias``
    (``[HV]``), ``g`` and ``beta`` are the raw gate projections a and b: the fused kernel forms the gates itself
    (:func:`~weaver_kernels.gdn_tree.naive.gdn_gates`' formula; the split form gets them from that function).
    ``peel_root`` (fused form at T = BT·n + 1, Neumann form at T = 2^n + 1, e.g. a budget of 16n drafts plus the
    root): node 0 runs as one recurrent step. The fused kernel does so when it finds node 0 an ancestor of every node
    and then solves n row blocks instead of n + 1 (H200, Qwen3.6-27B shape: 65 nodes 35.3 → 30.7 µs, 17 nodes
    12.5 → 8.7); the Neumann form folds it into the rows that descend from it (any forest), halving T_pad (65 nodes:
    20.1 µs). Off here by default; the decoding loop's GDN layers turn it on
    (``GatedDeltaNetLayerCache.peel_root``).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if HV % H:
        raise ValueError(f"value heads ({HV}) must be a multiple of q/k heads ({H})")
    if T > MAX_NODES:
        raise ValueError(f"gdn_tree_verify_triton supports at most {MAX_NODES} nodes, got {T}")
    if tuple(tree_mask.shape) != (T, T):
        raise ValueError(f"tree_mask must be [{T}, {T}], got {tuple(tree_mask.shape)}")
    scale = K**-0.5 if scale is None else float(scale)
    raw = A_log is not None
    if raw != (dt_bias is not None):
        raise ValueError("gdn_tree_verify: A_log and dt_bias go together")
    if raw and (A_log.numel() != HV or dt_bias.numel() != HV):
        raise ValueError(f"gdn_tree_verify: A_log and dt_bias must hold {HV} values (one per value head)")
    q, k, v = _last_contig(q), _last_contig(k), _last_contig(v)
    s0 = initial_state.contiguous()
    mask = tree_mask.contiguous()
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    o = torch.empty((B, T, HV, V), dtype=v.dtype, device=v.device) if o is None else o
    u = torch.empty((B, T, HV, V), dtype=torch.float32, device=v.device) if u is None else u
    gamma = torch.empty((B, T, HV), dtype=torch.float32, device=v.device) if gamma is None else gamma
    for name, t, shape in (("o", o, (B, T, HV, V)), ("u", u, (B, T, HV, V)), ("gamma", gamma, (B, T, HV))):
        if tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {shape} tensor")
    if u.dtype != torch.float32 or gamma.dtype != torch.float32:
        raise ValueError("u and gamma must be float32")
    TP = max(16, next_pow2(T))
    if BT not in (16, 32, 64) or (impl == "split" and BT != 16):
        raise ValueError(f"BT must be 16, 32 or 64 (16 for impl='split'), got {BT}")
    common = dict(
        H=H, HV=HV, K=K, V=V, TP=TP, BK=max(16, next_pow2(K)), BT=BT, LOG2_BT=BT.bit_length() - 1, BC=min(TP, 64) if BC is None else BC,
        L2NORM=bool(use_qk_l2norm_in_kernel), DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        # Triton's interpreter multiplies 16-bit dot operands as raw bit patterns: upcast there (exact anyway)
        DOT_F32=_INTERPRET or q.dtype == torch.float32,
    )
    args = (
        q, k, v, g, beta, s0, mask, o, u, gamma, A_log.contiguous() if raw else s0,
        dt_bias.contiguous() if raw else s0, T, scale,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        g.stride(0), g.stride(1), g.stride(2),
        beta.stride(0), beta.stride(1), beta.stride(2),
    )
    peel = peel_root and T > 1 and T % BT == 1  # the root as a recurrent step saves a whole row block
    peel_n = int(peel_root and T > 1 and next_pow2(T - 1) < next_pow2(T))  # ... and halves the Neumann form's T_pad
    if impl is None:  # Neumann for shallow trees where it measured faster, else resident/fused by T
        shallow = USE_NEUMANN and max_depth is not None and max_depth <= NEUMANN_MAX_DEPTH
        resident = T in RESIDENT_NODES and BT == 16 and not peel
        if shallow and BT == 16 and T - peel_n in NEUMANN_NODES:
            impl = "neumann"
        else:
            impl = "split" if T >= SPLIT_MIN_NODES else "resident" if resident else "fused"
    if inverse_precision is None:  # the Neumann solve in tf32 for 16-bit inputs (NEUMANN_PRECISION), else IEEE
        inverse_precision = NEUMANN_PRECISION if impl == "neumann" and q.dtype != torch.float32 else "ieee"
    _check_precision(inverse_precision)
    if impl == "split":
        if peel:
            raise ValueError(f"impl='split' has no root step (peel_root is the fused kernel's), got T={T}")
        if raw:  # the split kernels take formed gates
            g, beta = gdn_gates(g, beta, A_log, dt_bias)
        _verify_split(q, k, v, g, beta, s0, mask, o, u, gamma, T, scale, common, BV, num_warps)
        return o, u, gamma
    if impl == "resident":
        if TP > RESIDENT_MAX_NODES:
            raise ValueError(f"impl='resident' takes at most {RESIDENT_MAX_NODES} nodes, got {T}")
        if BT != 16 or peel:
            raise ValueError("impl='resident' has 16-row blocks and no root step (BT and peel_root are the fused "
                             f"kernel's), got BT={BT}, peel_root={peel_root} at T={T}")
        _verify_resident(args, common, raw, inverse_precision, BV, num_warps)
        return o, u, gamma
    if impl == "neumann":
        if next_pow2(T - peel_n) > NEUMANN_MAX_NODES or BT != 16:
            raise ValueError(f"impl='neumann' takes at most {NEUMANN_MAX_NODES} nodes ({NEUMANN_MAX_NODES} + 1 with "
                             f"peel_root) and has no row blocks (BT is the fused kernel's), got T={T}, BT={BT}")
        _verify_neumann(args, common, raw, inverse_precision, BV, num_warps, peel_n)
        return o, u, gamma
    if impl != "fused":
        raise ValueError(f"impl must be 'fused', 'split', 'resident', 'neumann' or None, got {impl!r}")
    if BV is None and (_INTERPRET or not autotune):
        BV = _VERIFY_CONFIGS[0].kwargs["BV"]
        num_warps = _VERIFY_CONFIGS[0].num_warps
    with launch_ctx(_INTERPRET):
        if BV is None:
            grid = lambda meta: (triton.cdiv(V, meta["BV"]), B * HV)  # noqa: E731
            _gdn_tree_verify_autotuned[grid](*args, **common, INV_PREC=inverse_precision, RAW_GATES=raw, PEEL=peel)
        else:
            _gdn_tree_verify_kernel[(triton.cdiv(V, BV), B * HV)](
                *args, **common, BV=BV, num_warps=num_warps, num_stages=1, INV_PREC=inverse_precision,
                RAW_GATES=raw, PEEL=peel,
            )
    return o, u, gamma


def _verify_resident(args, common, raw, inverse_precision, BV, num_warps):
    (q, k, v, g, beta, s0, mask, o, u, gamma, a_log, dt_bias, T, scale, *strides) = args
    sq, sk, sv, sg, sb = (strides[i:i + 3] for i in range(0, 15, 3))
    B, _, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT = common["BT"]
    pinv = torch.empty((B, HV, T, BT), dtype=torch.float32, device=u.device)
    c = {n: common[n] for n in ("H", "HV", "K", "TP", "BK", "BT", "L2NORM", "DOT_PREC", "DOT_F32")}
    if BV is None:
        cfg = _RESIDENT_CONFIGS[0]
        BV, num_warps = cfg.kwargs["BV"], cfg.num_warps
    with launch_ctx(_INTERPRET):
        _resident_prep_kernel[(triton.cdiv(T, BT), B * HV)](
            k, g, beta, mask, pinv, gamma, a_log, dt_bias, T, *sk, *sg, *sb, **c, LOG2_BT=common["LOG2_BT"],
            INV_PREC=inverse_precision, RAW_GATES=raw, num_warps=4, num_stages=1,
        )
        _resident_verify_kernel[(triton.cdiv(V, BV), B * HV)](
            q, k, v, beta, s0, mask, pinv, gamma, o, u, T, scale, *sq, *sk, *sv, *sb, **c, V=V, BV=BV,
            INV_PREC=inverse_precision, RAW_GATES=raw, num_warps=num_warps, num_stages=1,
        )


def _verify_split(q, k, v, g, beta, s0, mask, o, u, gamma, T, scale, common, BV, num_warps):
    B, _, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    NB = triton.cdiv(T, common["BT"])
    w = torch.empty_like(u)
    lbuf = torch.empty((B, HV, T, T), dtype=torch.float32, device=u.device)
    c = {n: common[n] for n in ("H", "HV", "K", "V", "TP", "BK", "BT", "LOG2_BT", "BC", "L2NORM", "DOT_PREC",
                                "DOT_F32")}
    c_out = {n: c[n] for n in c if n != "LOG2_BT"}
    c_solve = dict(HV=HV, V=V, TP=c["TP"], BT=c["BT"], DOT_PREC=c["DOT_PREC"])
    local_args = (k, v, g, beta, s0, mask, w, lbuf, gamma, T, k.stride(0), k.stride(1), k.stride(2),
                  v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1), g.stride(2),
                  beta.stride(0), beta.stride(1), beta.stride(2))
    out_args = (q, k, s0, mask, u, gamma, o, T, scale, q.stride(0), q.stride(1), q.stride(2),
                k.stride(0), k.stride(1), k.stride(2))
    if BV is None and _INTERPRET:
        BV, num_warps = _LOCAL_CONFIGS[0].kwargs["BV"], _LOCAL_CONFIGS[0].num_warps
    with launch_ctx(_INTERPRET):
        if BV is None:
            _split_local_autotuned[lambda m: (triton.cdiv(V, m["BV"]), NB, B * HV)](*local_args, **c)
            _split_solve_autotuned[lambda m: (triton.cdiv(V, m["BV"]), B * HV)](w, lbuf, u, T, **c_solve)
            _split_output_autotuned[lambda m: (triton.cdiv(V, m["BV"]), NB, B * HV)](*out_args, **c_out)
        else:
            kw = dict(BV=BV, num_warps=num_warps, num_stages=1)
            _split_local_kernel[(triton.cdiv(V, BV), NB, B * HV)](*local_args, **c, **kw)
            _split_solve_kernel[(triton.cdiv(V, BV), B * HV)](w, lbuf, u, T, **c_solve, **kw)
            _split_output_kernel[(triton.cdiv(V, BV), NB, B * HV)](*out_args, **c_out, **kw)


def gdn_tree_commit_triton(
    state: torch.Tensor,
    k: torch.Tensor,
    u: torch.Tensor,
    gamma: torch.Tensor,
    path: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    BV: int | None = None,
    num_warps: int = 4,
    chunk: int = 32,
    precision: str = "ieee",
    split_k: int = 1,
) -> torch.Tensor:
    """Triton version of :func:`~weaver_kernels.gdn_tree.naive.gdn_tree_commit_ref`: advances ``state`` in place.

    ``path`` (node indices root..leaf, on the device) may be right-padded with -1. ``chunk``: path entries per
    loop step (a power of two ≥ 16; capped at the padded path length). 32 measured fastest on the H200 for long
    paths (64-node chain: 9.5 µs vs 10.5 at 16; 64 and 128 no better; BENCHMARKS.md, Kernels).
    ``precision``: of the path product's dot (``"ieee"``, ``"tf32x3"`` or ``"tf32"``, as for the verify's inverse).
    ``split_k``: programs per value block along K (1, 2, 4: smaller state tiles, more programs in flight; measured
    slower on long paths, so 1 by default). ``BV``: value columns per program (default 16, the fastest measured).
    """
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    if not state.is_contiguous():
        raise ValueError("state must be contiguous [B, HV, K, V]")
    k = _last_contig(k)
    u = u.contiguous()
    gamma = gamma.contiguous()
    path = path.to(device=state.device)
    L = path.numel()
    BKF = max(16, next_pow2(K))
    if split_k not in (1, 2, 4) or BKF // split_k < 16:
        raise ValueError(f"split_k must be 1, 2 or 4 and leave at least 16 state rows per program, got {split_k}")
    BK = BKF // split_k
    if BV is None:  # 16 (8 programs per value head at V = 128): 5.0 µs vs 5.9 at 32 for 7-8-node paths, 9.4 vs 9.7
        BV = 16  # for a 64-node chain (H200, Qwen3.6-27B shape, BENCHMARKS.md "Session 8"); split_k only lost
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    _check_precision(precision)
    LP = max(16, next_pow2(L))
    with launch_ctx(_INTERPRET):
        _gdn_tree_commit_kernel[(triton.cdiv(V, BV), B * HV, split_k)](
            state, k, u, gamma, path, L, T,
            k.stride(0), k.stride(1), k.stride(2),
            H=H, HV=HV, K=K, V=V, LP=LP, BK=BK, BKF=BKF, BV=BV,
            L2NORM=bool(use_qk_l2norm_in_kernel), CH=min(chunk, LP), PREC=precision, num_warps=num_warps,
            num_stages=1,
        )
    return state

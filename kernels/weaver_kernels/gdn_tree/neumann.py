"""Neumann tree GDN verify: no serial chain of row blocks.

N = −β ⊙ (K Kᵀ ⊙ D ⊙ M_strict) is nilpotent with N^(d+1) = 0 for a tree of depth d (N^m links a node only to
ancestors m levels up), so (I + A)^{-1} R = Σ_{m≤d} N^m R, evaluated by Horner: U ← R + N U, d times (node i's row is
exact after depth(i) steps). The same math as the fused form's 16×16 diagonal inverse, over the whole tree. Two
launches:

1. prep (grid row blocks × B·HV, parallel): Γ, the [T_pad, T_pad] coefficient matrices N and C = Q Kᵀ ⊙ D ⊙ M
   (fp32 scratch, L2-resident), and the depth d (read off the mask: any tree is solved exactly).
2. solve (grid V/BV × B·HV): R = β (V − e^Γ K S0), U by d dense [T_pad, T_pad]·[T_pad, BV] dots, O = e^Γ Q S0 + C U.

d dots instead of ⌈T/16⌉ latency-bound row blocks: it pays for shallow trees (a block drafter's trees have depth
≤ block size − 1) and loses on long chains (``dispatch`` keeps those on the row-block forms). T_pad ≤ 128.
Precision: the Horner products run at ``precision`` (``dispatch.NEUMANN_PRECISION`` for 16-bit inputs by default).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import INTERPRET, head_inputs, head_program, lanes, node_rows, rsum, state_tile, tree_depth
from ..utils import launch_ctx, next_pow2
from .common import gate_beta, gate_decay, root_step

_NEUMANN_PREP_ROWS = 16
# the solve's config by padded node count (None: any other), as measured (BENCHMARKS.md, Kernels)
if INTERPRET:
    _NEUMANN_CONFIGS = {None: triton.Config({"BV": 16}, num_warps=4, num_stages=1)}
else:
    _NEUMANN_CONFIGS = {None: triton.Config({"BV": 32}, num_warps=4, num_stages=1),
                        128: triton.Config({"BV": 64}, num_warps=8, num_stages=1)}


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
    i_b64, i_hv, i_h = head_program(H, HV)
    o_k, m_k = lanes(0, BK, K)
    o_n, m_n = lanes(0, TP, T - PEEL)
    t_r, m_r = lanes(i_blk, BR, T - PEEL)

    g_base = g + i_b64 * sg_b + i_hv * sg_h
    M = tl.load(tmask + (o_n[:, None] + PEEL) * T + o_n[None, :] + PEEL, mask=m_n[:, None] & m_n[None, :],
                other=0) != 0
    g_all = tl.load(g_base + (o_n + PEEL) * sg_t, mask=m_n, other=0.0).to(tl.float32)
    if RAW_GATES:
        g_all = tl.where(m_n, gate_decay(g_all, a_log, dt_bias, i_hv), 0.0)
    G_c = rsum(tl.where(M, g_all[None, :], 0.0), axis=1)
    if i_blk == 0:
        gm_base = node_rows(gamma, i_b64, i_hv, T, HV, 1)
        if PEEL:
            g0 = tl.load(g_base).to(tl.float32)
            if RAW_GATES:
                g0 = gate_decay(g0, a_log, dt_bias, i_hv)
            tl.store(gm_base, g0)
            desc = tl.load(tmask + (o_n + 1) * T, mask=m_n, other=0) != 0
            tl.store(gm_base + (o_n + 1) * HV, G_c + tl.where(desc, g0, 0.0), mask=m_n)
        else:
            tl.store(gm_base + o_n * HV, G_c, mask=m_n)
        if tl.program_id(1) == 0:  # (one program writes the depth)
            tl.store(depth, tree_depth(M))
    M_r = tl.load(tmask + (t_r[:, None] + PEEL) * T + o_n[None, :] + PEEL, mask=m_r[:, None] & m_n[None, :],
                  other=0) != 0
    G_r = rsum(tl.where(M_r, g_all[None, :], 0.0), axis=1)
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
        rk_c = tl.rsqrt(rsum(kf * kf, axis=0) + 1e-6)
        kr = k_r.to(tl.float32)
        qr = q_r.to(tl.float32)
        kk = kk * tl.rsqrt(rsum(kr * kr, axis=1) + 1e-6)[:, None] * rk_c[None, :]
        qk = qk * tl.rsqrt(rsum(qr * qr, axis=1) + 1e-6)[:, None] * rk_c[None, :]
    b_r = tl.load(beta + i_b64 * sb_b + i_hv * sb_h + (t_r + PEEL) * sb_t, mask=m_r, other=0.0).to(tl.float32)
    if RAW_GATES:
        b_r = tl.where(m_r, gate_beta(b_r, beta.dtype.element_ty), 0.0)
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
    i_b64, i_hv, i_h = head_program(H, HV)
    o_k, m_k = lanes(0, BK, K)
    o_v, m_v = lanes(tl.program_id(0), BV, V)
    o_n, m_n = lanes(0, TP, T - PEEL)
    m_nk = m_n[:, None] & m_k[None, :]
    m_nv = m_n[:, None] & m_v[None, :]
    t_n = o_n + PEEL  # node of local row n

    q_base, k_base, v_base, g_base, b_base = head_inputs(q, k, v, g, beta, i_b64, i_hv, i_h, sq_b, sq_h, sk_b, sk_h,
                                                         sv_b, sv_h, sg_b, sg_h, sb_b, sb_h)
    o_base = node_rows(o, i_b64, i_hv, T, HV, V)
    u_base = node_rows(u, i_b64, i_hv, T, HV, V)

    d_max = tl.load(depth)
    G = tl.load(node_rows(gamma, i_b64, i_hv, T, HV, 1) + t_n * HV, mask=m_n, other=0.0)
    b_all = tl.load(b_base + t_n * sb_t, mask=m_n, other=0.0).to(tl.float32)
    if RAW_GATES:
        b_all = tl.where(m_n, gate_beta(b_all, beta.dtype.element_ty), 0.0)
    K_all = tl.load(k_base + t_n[:, None] * sk_t + o_k[None, :], mask=m_nk, other=0.0).to(tl.float32)
    Q_all = tl.load(q_base + t_n[:, None] * sq_t + o_k[None, :], mask=m_nk, other=0.0).to(tl.float32)
    v_all = tl.load(v_base + t_n[:, None] * sv_t + o_v[None, :], mask=m_nv, other=0.0).to(tl.float32)
    S = tl.load(state_tile(s0, i_b64, i_hv, HV, K, V) + o_k[:, None] * V + o_v[None, :],
                mask=m_k[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    kS = tl.dot(K_all, S, input_precision=DOT_PREC)  # [TP, BV]
    qS = tl.dot(Q_all, S, input_precision=DOT_PREC)
    if PEEL:
        # the root as one recurrent step, S1 = e^{g0} S0 + k0 u0ᵀ, folded into the rows that descend from it:
        # K S1 = e^{g0} K S0 + (K k0) u0ᵀ (likewise Q); their decays from S1 are e^{Γ − g0}
        g0 = tl.load(g_base).to(tl.float32)
        if RAW_GATES:
            g0 = gate_decay(g0, a_log, dt_bias, i_hv)
        q0, k0, e0, u0 = root_step(q_base, k_base, v_base, b_base, o_k, m_k, o_v, m_v, S, g0,
                                    beta.dtype.element_ty, L2NORM, RAW_GATES)
        o0 = e0 * rsum(q0[:, None] * S, axis=0) + rsum(q0 * k0, axis=0) * u0
        tl.store(u_base + o_v, u0, mask=m_v)
        tl.store(o_base + o_v, (o0 * scale).to(o.dtype.element_ty), mask=m_v)
        desc = tl.load(tmask + t_n * T, mask=m_n, other=0) != 0
        kS = tl.where(desc[:, None], e0 * kS + rsum(K_all * k0[None, :], axis=1)[:, None] * u0[None, :], kS)
        qS = tl.where(desc[:, None], e0 * qS + rsum(Q_all * k0[None, :], axis=1)[:, None] * u0[None, :], qS)
        G = G - tl.where(desc, g0, 0.0)
    if L2NORM:
        kS = kS * tl.rsqrt(rsum(K_all * K_all, axis=1) + 1e-6)[:, None]
        qS = qS * tl.rsqrt(rsum(Q_all * Q_all, axis=1) + 1e-6)[:, None]
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


def verify_neumann(args, common, raw, precision, BV, num_warps, peel):
    """Launch prep and solve on :func:`~.chunk.gdn_tree_verify_triton`'s ``args`` and ``common`` constexprs; ``peel``:
    node 0 as a recurrent step folded into the rows that descend from it."""
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
    with launch_ctx(INTERPRET):
        _neumann_prep_kernel[(TP // _NEUMANN_PREP_ROWS, B * HV)](
            q, k, g, beta, mask, coef, gamma, depth, a_log, dt_bias, T, *sq, *sk, *sg, *sb, **c, TP=TP,
            BR=_NEUMANN_PREP_ROWS, RAW_GATES=raw, PEEL=peel, num_warps=4, num_stages=1,
        )
        _neumann_solve_kernel[(triton.cdiv(V, BV), B * HV)](
            q, k, v, g, beta, s0, mask, coef, gamma, depth, o, u, a_log, dt_bias, T, scale, *sq, *sk, *sv, *sg, *sb,
            **c, V=V, TP=TP, BV=BV, SOLVE_PREC=precision, RAW_GATES=raw, PEEL=peel, num_warps=num_warps,
            num_stages=1,
        )

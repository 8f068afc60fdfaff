"""Resident tree GDN verify: the fused form's math, right-looking, with every row's right-hand side in registers.

Two launches:

1. prep (grid blocks × B·HV, parallel): Γ of every node, and each row block's diagonal inverse
   P_i = (I + A_ii)^{-1} ([B, HV, T, BT] scratch, fp32).
2. verify (grid V/BV × B·HV): R = β ⊙ (V − e^Γ ⊙ K S0) for all T rows at once ([T_pad, BV] registers); then per row
   block i: U_i = P_i R_i (one dot against R with P_i placed at block i's columns, so no row extraction),
   R −= A[:, i] U_i for the rows below the block, O += (Q Kᵀ ⊙ D)[:, i] U_i.

The serial chain per block is two dependent dots in registers: nothing of U is stored and read back (u is only
written, for the commit), so there is no barrier, and the U-independent loads (K_i, mask columns, P_i) do not wait on
the solve (one pipeline stage: two measured slower). The price: K and Q of all T rows stay resident ([T_pad, K] each),
so T_pad ≤ 128 (``dispatch.RESIDENT_MAX_NODES``). It beats the fused form only at four row blocks, where its prep
launch costs less than the serial blocks save (``dispatch.RESIDENT_NODES``; BENCHMARKS.md, Kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import INTERPRET, head_program, lanes, node_rows, rsum, state_tile
from ..utils import launch_ctx
from .common import block_inverse, gate_beta, gate_decay

# the measured config (BENCHMARKS.md, Kernels); the tests' small heads under the interpreter
if INTERPRET:
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
    i_b64, i_hv, i_h = head_program(H, HV)
    o_k, m_k = lanes(0, BK, K)
    o_n, m_n = lanes(0, TP, T)
    o_r = tl.arange(0, BT)
    t_r, m_r = lanes(tl.program_id(0), BT, T)

    g_all = tl.load(g + i_b64 * sg_b + i_hv * sg_h + o_n * sg_t, mask=m_n, other=0.0).to(tl.float32)
    if RAW_GATES:
        g_all = tl.where(m_n, gate_decay(g_all, a_log, dt_bias, i_hv), 0.0)
    M_i = tl.load(tmask + t_r[:, None] * T + o_n[None, :], mask=m_r[:, None] & m_n[None, :], other=0) != 0
    G_i = rsum(tl.where(M_i, g_all[None, :], 0.0), axis=1)
    tl.store(node_rows(gamma, i_b64, i_hv, T, HV, 1) + t_r * HV, G_i, mask=m_r)

    k_i = tl.load(k + i_b64 * sk_b + i_h * sk_h + t_r[:, None] * sk_t + o_k[None, :],
                  mask=m_r[:, None] & m_k[None, :], other=0.0)
    if DOT_F32:
        k_i = k_i.to(tl.float32)
    b_i = tl.load(beta + i_b64 * sb_b + i_hv * sb_h + t_r * sb_t, mask=m_r, other=0.0).to(tl.float32)
    if RAW_GATES:
        b_i = tl.where(m_r, gate_beta(b_i, beta.dtype.element_ty), 0.0)
    kk_d = tl.dot(k_i, tl.trans(k_i), input_precision=DOT_PREC)
    if L2NORM:
        kf_i = k_i.to(tl.float32)
        rk_i = tl.rsqrt(rsum(kf_i * kf_i, axis=1) + 1e-6)
        kk_d = kk_d * rk_i[:, None] * rk_i[None, :]
    M_d = tl.load(tmask + t_r[:, None] * T + t_r[None, :], mask=m_r[:, None] & m_r[None, :], other=0) != 0
    D_d = tl.exp(tl.where(M_d, G_i[:, None] - G_i[None, :], float("-inf")))
    P = block_inverse(kk_d, D_d, b_i, BT, LOG2_BT, INV_PREC)
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
    i_b64, i_hv, i_h = head_program(H, HV)
    o_k, m_k = lanes(0, BK, K)
    o_v, m_v = lanes(tl.program_id(0), BV, V)
    o_n, m_n = lanes(0, TP, T)
    o_r = tl.arange(0, BT)

    k_base = k + i_b64 * sk_b + i_h * sk_h
    o_base = node_rows(o, i_b64, i_hv, T, HV, V)
    u_base = node_rows(u, i_b64, i_hv, T, HV, V)
    gm_base = node_rows(gamma, i_b64, i_hv, T, HV, 1)
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
        b_all = tl.where(m_n, gate_beta(b_all, beta.dtype.element_ty), 0.0)
    G_all = tl.load(gm_base + o_n * HV, mask=m_n, other=0.0)
    S = tl.load(state_tile(s0, i_b64, i_hv, HV, K, V) + o_k[:, None] * V + o_v[None, :],
                mask=m_k[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    kS = tl.dot(K_all.to(tl.float32), S, input_precision=DOT_PREC)
    qS = tl.dot(Q_all.to(tl.float32), S, input_precision=DOT_PREC)
    if L2NORM:
        kf = K_all.to(tl.float32)
        qf = Q_all.to(tl.float32)
        rk_all = tl.rsqrt(rsum(kf * kf, axis=1) + 1e-6)
        rq_all = tl.rsqrt(rsum(qf * qf, axis=1) + 1e-6)
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
            D_col = D_col * tl.rsqrt(rsum(kf_c * kf_c, axis=0) + 1e-6)[None, :]
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


def verify_resident(args, common, raw, inverse_precision, BV, num_warps):
    """Launch prep and verify on :func:`~.chunk.gdn_tree_verify_triton`'s ``args`` and ``common`` constexprs."""
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
    with launch_ctx(INTERPRET):
        _resident_prep_kernel[(triton.cdiv(T, BT), B * HV)](
            k, g, beta, mask, pinv, gamma, a_log, dt_bias, T, *sk, *sg, *sb, **c, LOG2_BT=common["LOG2_BT"],
            INV_PREC=inverse_precision, RAW_GATES=raw, num_warps=4, num_stages=1,
        )
        _resident_verify_kernel[(triton.cdiv(V, BV), B * HV)](
            q, k, v, beta, s0, mask, pinv, gamma, o, u, T, scale, *sq, *sk, *sv, *sb, **c, V=V, BV=BV,
            INV_PREC=inverse_precision, RAW_GATES=raw, num_warps=num_warps, num_stages=1,
        )

"""Tree KDA verify in Triton: two launches, a parallel prep of the pair tiles and a right-looking blockwise solve;
writes no state.

The system of docs/DESIGN.md §13, ``(I + A) U = β ⊙ (V − (K ⊙ e^Γ) S0)`` and
``O = scale · ((Q ⊙ e^Γ) S0 + P U)``, solved over row blocks of 16 nodes as the resident GDN form does
(:mod:`..gdn_tree.resident`): every row's right-hand side in registers, and per row block i
``U_i = (I + A_ii)^{-1} R_i``, then ``R −= A[:, i] U_i`` and ``O += P[:, i] U_i``. The difference from GDN is the
decay: per channel, so the pair scores of ``A`` and ``P``, ``Σ_c k_ic k_jc exp(Γ_ic − Γ_jc)``, are not one matmul of
decayed keys. Each [16, 16] tile folds the decay into the operands against a reference per channel,
``R_c = max_{i ∈ rows} Γ_ic``: ``(K_I ⊙ e^{Γ_I − R}) (K_J ⊙ e^{R − Γ_J})ᵀ``, IEEE fp32 dots (as the GDN forms' fp32
K·Kᵀ), the ancestor mask after them: the same scores up to rounding for the channels whose spread
``R_c − min_{j ∈ cols} Γ_jc`` stays within ``PAIR_SPREAD_MAX`` (both factors finite). A channel past it is zeroed in
those operands and added exactly, BKW (16) channels at a time as a [16, 16, BKW] product with the mask inside the exp
(the overflow-safe form of §13: every exponent kept is ≤ 0).
Why dots: an exp per pair and channel made this verify slow; the dots need an exp per node and channel.
Why per channel: a launch waits for its slowest tile, so a whole tile on the exact form was the critical path.

Launches: ``_kda_prep_kernel`` (grid: the NB·(NB+1)/2 lower-triangle tiles × B·HV, NB row blocks) forms, for tile
(row block i, column block c ≤ i), Γ of both blocks from the gates (ancestor-mask rows · g, the next column block's
loads in flight), the tile's pair scores over all K channels (the dot operands staged through a scratch slot per
program), and stores ``β_i A_ic`` or, on the diagonal,
the block inverse ``(I + A_ii)^{-1}`` in its place (and Γ of the block), and the P tile; ``_kda_solve_kernel``
(grid V / BV × B·HV) the solve: each program owns one value head and BV value columns, reads its S0 tile once and
the tiles of block i + 1 while it solves block i. Nothing of U is read back, so no barrier.
Why Γ is formed in every tile: a launch of its own cost more than the few extra [16, 16] · [16, K] dots per tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gdn_tree.common import block_inverse, gate_beta, last_contig
from ..triton_utils import (
    INTERPRET,
    head_program,
    lanes,
    maximum,
    minimum,
    node_rows,
    rsum,
    state_tile,
)
from ..utils import launch_ctx, next_pow2

MAX_NODES = 256  # as the GDN verify's limit: a budget of 128 drafts plus the root
# widest Γ spread (nats) of a channel of a pair tile in the dots: column factors ≤ e^64 stay finite (fp32 max
# e^88.7), and a row factor underflows (< e^-87.3) only where its pair's decay is < e^-23, below fp32's resolution
PAIR_SPREAD_MAX = 64.0
BT = 16  # nodes per row block
# warps per solve program: its [T_pad, BV] tiles and FMA dots spill at 4 (sm_90 ptxas)
SOLVE_WARPS = 8


def solve_bv(T: int) -> int:
    """Value columns per solve program: 32 up to 64 nodes (128 programs at Kimi Linear's 32 heads, one per SM), 16
    beyond (the [T_pad, 32] tiles spill); the interpreter's small heads get several value blocks at 16."""
    return 16 if INTERPRET or T > 64 else 32


@triton.jit
def kda_gate(f, a_log, dt_bias, i_hv, o_k, m_k, K: tl.constexpr):
    """KimiLinear's g of value head ``i_hv`` from raw projections ``f [N, BK]``: −exp(A_log) · softplus(f + dt_bias)
    with transformers' softplus, log(1 + exp(x)) up to 20 and x above (:func:`..kda_tree.naive.kda_gates`)."""
    x = f + tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)[None, :]
    return -tl.exp(tl.load(a_log + i_hv).to(tl.float32)) * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))


@triton.jit
def _gate_block(g_base, tmask, t_r, m_r, t_c, m_c, b, last, T, sg_t, o_k, m_k, BT: tl.constexpr):
    """The U-free operands of column block ``b`` of the Γ dots (none past block ``last``): its raw gates ``[BT, BK]``
    and the ancestor-mask tiles of the row and column blocks against it, as fp32."""
    t_b, m_b = lanes(b, BT, T)
    m_b = m_b & (t_b * 0 + b <= last)  # (a vector test: the interpreter mishandles bool-scalar masks)
    g_b = tl.load(g_base + t_b[:, None] * sg_t + o_k[None, :], mask=m_b[:, None] & m_k[None, :], other=0.0)
    M_rb = tl.load(tmask + t_r[:, None] * T + t_b[None, :], mask=m_r[:, None] & m_b[None, :], other=0)
    M_cb = tl.load(tmask + t_c[:, None] * T + t_b[None, :], mask=m_c[:, None] & m_b[None, :], other=0)
    return g_b.to(tl.float32), (M_rb != 0).to(tl.float32), (M_cb != 0).to(tl.float32), m_b


@triton.jit
def _dot_chunk(sc, kd, BT: tl.constexpr, BK: tl.constexpr, KD: tl.constexpr):
    """Channels ``kd .. kd + KD − 1`` of the three dot operands in a prep program's scratch slot (none past BK)."""
    o_d = kd + tl.arange(0, KD)
    chunk = tl.arange(0, BT)[:, None] * BK + o_d[None, :]
    m = (o_d < BK)[None, :]
    return (tl.load(sc + chunk, mask=m, other=0.0), tl.load(sc + BT * BK + chunk, mask=m, other=0.0),
            tl.load(sc + 2 * BT * BK + chunk, mask=m, other=0.0))


@triton.jit
def _kda_prep_kernel(
    q, k, g, beta, tmask, gamma, a_log, dt_bias, a_out, qk_out, scratch, T,
    sq_b, sq_t, sq_h,
    sk_b, sk_t, sk_h,
    sg_b, sg_t, sg_h,
    sb_b, sb_t, sb_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, KD: tl.constexpr, BKW: tl.constexpr,
    BT: tl.constexpr, LOG2_BT: tl.constexpr, NB: tl.constexpr, L2NORM: tl.constexpr, RAW_GATES: tl.constexpr,
    SPREAD_MAX: tl.constexpr,
):
    """Tile ``program_id(0) = i·(i+1)/2 + c`` (row block i, column block c ≤ i) of one value head: into ``a_out``
    ``β_i rk_i rk_j (K Kᵀ ⊙ D)_ij`` (c < i) or the diagonal block's ``(I + A_ii)^{-1}`` (c = i), into ``qk_out``
    ``rq_i rk_j (Q Kᵀ ⊙ D)_ij`` (``[B, HV, T, T]``; rk, rq the l2 norms' reciprocals), and Γ of the block
    (c = i)."""
    i_b64, i_hv, i_h = head_program(H, HV)
    p = tl.program_id(0)
    i = p * 0
    for r in tl.static_range(1, NB):
        i += (p >= r * (r + 1) // 2).to(tl.int32)
    c = p - i * (i + 1) // 2
    o_k, m_k = lanes(0, BK, K)
    t_r, m_r = lanes(i, BT, T)
    t_c, m_c = lanes(c, BT, T)
    m_rk = m_r[:, None] & m_k[None, :]
    m_ck = m_c[:, None] & m_k[None, :]
    q_base, k_base = q + i_b64 * sq_b + i_h * sq_h, k + i_b64 * sk_b + i_h * sk_h
    g_base = g + i_b64 * sg_b + i_hv * sg_h

    # the keys and queries do not wait on Γ: their loads go first
    k_r = tl.load(k_base + t_r[:, None] * sk_t + o_k[None, :], mask=m_rk, other=0.0).to(tl.float32)
    q_r = tl.load(q_base + t_r[:, None] * sq_t + o_k[None, :], mask=m_rk, other=0.0).to(tl.float32)
    k_c = tl.load(k_base + t_c[:, None] * sk_t + o_k[None, :], mask=m_ck, other=0.0).to(tl.float32)
    M = tl.load(tmask + t_r[:, None] * T + t_c[None, :], mask=m_r[:, None] & m_c[None, :], other=0) != 0

    # Γ of the row and column blocks: ancestor-mask rows · g over the column blocks up to i (ancestors come first),
    # block b + 1's loads issued before block b's dots
    G_r = tl.full([BT, BK], 0.0, tl.float32)
    G_c = tl.full([BT, BK], 0.0, tl.float32)
    g_n, M_rn, M_cn, m_n = _gate_block(g_base, tmask, t_r, m_r, t_c, m_c, 0, i, T, sg_t, o_k, m_k, BT)
    for b in range(0, i + 1):
        g_b, M_rb, M_cb, m_b = g_n, M_rn, M_cn, m_n
        g_n, M_rn, M_cn, m_n = _gate_block(g_base, tmask, t_r, m_r, t_c, m_c, b + 1, i, T, sg_t, o_k, m_k, BT)
        if RAW_GATES:
            g_b = tl.where(m_b[:, None] & m_k[None, :], kda_gate(g_b, a_log, dt_bias, i_hv, o_k, m_k, K), 0.0)
        G_r += tl.dot(M_rb, g_b, input_precision="ieee")
        if (b <= c) & (c < i):  # (the column block's mask rows are 0 past c; on the diagonal it is the row block)
            G_c += tl.dot(M_cb, g_b, input_precision="ieee")
    if c == i:
        G_c = G_r

    # per channel: the split exponent's reference (row factors ≤ 1) where the spread allows it; the rest is wide
    R = tl.reduce(tl.where(m_r[:, None], G_r, float("-inf")), 0, maximum)  # [BK]
    narrow = (R - tl.reduce(tl.where(m_c[:, None], G_c, float("inf")), 0, minimum) <= SPREAD_MAX)
    narrow = narrow & (R > float("-inf")) & m_k  # NaN, inf: wide
    wide = m_k & ~narrow
    R = tl.where(narrow, R, 0.0)
    x_r = m_rk & narrow[None, :]
    x_c = m_ck & narrow[None, :]
    e_r = tl.exp(tl.where(x_r, G_r - R[None, :], 0.0))
    e_c = tl.exp(tl.where(x_c, R[None, :] - G_c, 0.0))
    rk_r = tl.full([BT], 1.0, tl.float32)
    rq_r = tl.full([BT], 1.0, tl.float32)
    rk_c = tl.full([BT], 1.0, tl.float32)
    if L2NORM:
        rk_r = tl.rsqrt(rsum(k_r * k_r, axis=1) + 1e-6)
        rq_r = tl.rsqrt(rsum(q_r * q_r, axis=1) + 1e-6)
        rk_c = tl.rsqrt(rsum(k_c * k_c, axis=1) + 1e-6)
    # the dots' operands (wide and padding channels zeroed) through this program's scratch slot, read back KD
    # channels at a time: a [BT, BK] · [BK, BT] dot on FMAs holds whole operand rows in registers
    o_t = tl.arange(0, BT)
    sc = scratch + ((i_b64 * HV + i_hv) * (NB * (NB + 1) // 2) + p) * (5 * BT * BK)
    slot = o_t[:, None] * BK + o_k[None, :]
    tl.store(sc + slot, tl.where(x_r, k_r * e_r, 0.0))
    tl.store(sc + BT * BK + slot, tl.where(x_r, q_r * e_r, 0.0))
    tl.store(sc + 2 * BT * BK + slot, tl.where(x_c, k_c * e_c, 0.0))
    n_wide = rsum(wide.to(tl.int32), axis=0)
    if n_wide > 0:  # Γ too, for the exact form below
        tl.store(sc + 3 * BT * BK + slot, G_r)
        tl.store(sc + 4 * BT * BK + slot, G_c)
    tl.debug_barrier()  # the stores above are read back below by other threads of this program
    # a loop, not unrolled: unrolled, every chunk's loads are hoisted and the registers spill; chunk n + 1's loads
    # are issued before chunk n's dots
    kk = tl.full([BT, BT], 0.0, tl.float32)
    qk = tl.full([BT, BT], 0.0, tl.float32)
    kr_n, qr_n, kc_n = _dot_chunk(sc, 0, BT, BK, KD)
    for kd in range(0, BK, KD):
        kr_d, qr_d, kc_d = kr_n, qr_n, kc_n
        kr_n, qr_n, kc_n = _dot_chunk(sc, kd + KD, BT, BK, KD)
        kT = tl.trans(kc_d)  # [KD, BT]
        kk += tl.dot(kr_d, kT, input_precision="ieee")
        qk += tl.dot(qr_d, kT, input_precision="ieee")

    # the wide channels, exactly, BKW at a time
    if n_wide > 0:
        for kw in tl.static_range(0, BK, BKW):
            o_w = kw + tl.arange(0, BKW)
            m_w = o_w < K
            G_rw = tl.load(sc + 3 * BT * BK + o_t[:, None] * BK + o_w[None, :])
            G_cw = tl.load(sc + 4 * BT * BK + o_t[:, None] * BK + o_w[None, :])
            # the same test as above on the same values: the same channels
            R_w = tl.reduce(tl.where(m_r[:, None], G_rw, float("-inf")), 0, maximum)
            narrow_w = R_w - tl.reduce(tl.where(m_c[:, None], G_cw, float("inf")), 0, minimum) <= SPREAD_MAX
            wide_w = m_w & ~(narrow_w & (R_w > float("-inf")))
            if rsum(wide_w.to(tl.int32), axis=0) > 0:
                m_rw = m_r[:, None] & m_w[None, :]
                m_cw = m_c[:, None] & m_w[None, :]
                k_rw = tl.load(k_base + t_r[:, None] * sk_t + o_w[None, :], mask=m_rw, other=0.0).to(tl.float32)
                q_rw = tl.load(q_base + t_r[:, None] * sq_t + o_w[None, :], mask=m_rw, other=0.0).to(tl.float32)
                k_cw = tl.load(k_base + t_c[:, None] * sk_t + o_w[None, :], mask=m_cw, other=0.0).to(tl.float32)
                x = M[:, :, None] & wide_w[None, None, :]
                kD = k_cw[None, :, :] * tl.exp(tl.where(x, G_rw[:, None, :] - G_cw[None, :, :], float("-inf")))
                kk += rsum(k_rw[:, None, :] * kD, axis=2)
                qk += rsum(q_rw[:, None, :] * kD, axis=2)

    # the mask after the dots: a non-ancestor entry's sum may be large there (the wide terms are 0 off it)
    kk = tl.where(M, kk, 0.0) * rk_r[:, None] * rk_c[None, :]
    qk = tl.where(M, qk, 0.0) * rq_r[:, None] * rk_c[None, :]
    b_r = tl.load(beta + i_b64 * sb_b + i_hv * sb_h + t_r * sb_t, mask=m_r, other=0.0).to(tl.float32)
    if RAW_GATES:  # β = sigmoid(b) in b's dtype, as the module computes it
        b_r = tl.where(m_r, gate_beta(b_r, beta.dtype.element_ty), 0.0)
    if i == c:
        tl.store(node_rows(gamma, i_b64, i_hv, T, HV, K) + t_r[:, None] * (HV * K) + o_k[None, :], G_r, mask=m_rk)
        a_t = block_inverse(kk, 1.0, b_r, BT, LOG2_BT, "ieee")
    else:
        a_t = kk * b_r[:, None]
    tile = (i_b64 * HV + i_hv) * T * T + t_r[:, None] * T + t_c[None, :]
    m_t = m_r[:, None] & m_c[None, :]
    tl.store(a_out + tile, a_t, mask=m_t)
    tl.store(qk_out + tile, qk, mask=m_t)


@triton.jit
def _solve_block(a_in, qk_in, pair_base, o_n, m_n, T, i, NB, BT: tl.constexpr):
    """The U-free operands of row block ``i``'s step (none past the last block): the inverse placed at the block's
    columns ``[BT, TP]``, the A column below the block and the P column from the block down (``[TP, BT]``)."""
    t_c, m_c = lanes(i, BT, T)
    m_c = m_c & (t_c * 0 + i < NB)  # (a vector test: the interpreter mishandles bool-scalar masks)
    r0 = i * BT
    in_blk = (o_n >= r0) & (o_n < r0 + BT) & m_n
    Y = tl.load(a_in + pair_base + t_c[:, None] * T + o_n[None, :], mask=m_c[:, None] & in_blk[None, :], other=0.0)
    A_col = tl.load(a_in + pair_base + o_n[:, None] * T + t_c[None, :],
                    mask=((o_n >= r0 + BT) & m_n)[:, None] & m_c[None, :], other=0.0)
    P_col = tl.load(qk_in + pair_base + o_n[:, None] * T + t_c[None, :],
                    mask=((o_n >= r0) & m_n)[:, None] & m_c[None, :], other=0.0)
    return Y, A_col, P_col


@triton.jit
def _kda_solve_kernel(
    q, k, v, beta, s0, gamma, a_in, qk_in, o, u,
    T, scale,
    sq_b, sq_t, sq_h,
    sk_b, sk_t, sk_h,
    sv_b, sv_t, sv_h,
    sb_b, sb_t, sb_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    TP: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    L2NORM: tl.constexpr, RAW_GATES: tl.constexpr,
):
    i_b64, i_hv, i_h = head_program(H, HV)
    o_v, m_v = lanes(tl.program_id(0), BV, V)
    o_n, m_n = lanes(0, TP, T)
    NB = (T + BT - 1) // BT
    pair_base = (i_b64 * HV + i_hv) * T * T  # this head's [T, T] tiles
    Y_n, A_n, P_n = _solve_block(a_in, qk_in, pair_base, o_n, m_n, T, 0, NB, BT)  # in flight during the prologue

    # every row at once, KC channels at a time: (K ⊙ e^Γ) S0 and (Q ⊙ e^Γ) S0, the rows' norms beside
    k_base, q_base = k + i_b64 * sk_b + i_h * sk_h, q + i_b64 * sq_b + i_h * sq_h
    gm_base = node_rows(gamma, i_b64, i_hv, T, HV, K)  # (_kda_prep_kernel)
    s_base = state_tile(s0, i_b64, i_hv, HV, K, V)
    kS = tl.full([TP, BV], 0.0, tl.float32)
    qS = tl.full([TP, BV], 0.0, tl.float32)
    ssk = tl.full([TP], 0.0, tl.float32)
    ssq = tl.full([TP], 0.0, tl.float32)
    for kc in tl.static_range(0, BK, KC):
        o_kc = kc + tl.arange(0, KC)
        m_kc = o_kc < K
        m_nk = m_n[:, None] & m_kc[None, :]
        K_c = tl.load(k_base + o_n[:, None] * sk_t + o_kc[None, :], mask=m_nk, other=0.0).to(tl.float32)
        Q_c = tl.load(q_base + o_n[:, None] * sq_t + o_kc[None, :], mask=m_nk, other=0.0).to(tl.float32)
        eG = tl.exp(tl.load(gm_base + o_n[:, None] * (HV * K) + o_kc[None, :], mask=m_nk, other=0.0))
        S_c = tl.load(s_base + o_kc[:, None] * V + o_v[None, :], mask=m_kc[:, None] & m_v[None, :],
                      other=0.0).to(tl.float32)
        kS += tl.dot(K_c * eG, S_c, input_precision="ieee")
        qS += tl.dot(Q_c * eG, S_c, input_precision="ieee")
        ssk += rsum(K_c * K_c, axis=1)
        ssq += rsum(Q_c * Q_c, axis=1)
    if L2NORM:
        kS = kS * tl.rsqrt(ssk + 1e-6)[:, None]
        qS = qS * tl.rsqrt(ssq + 1e-6)[:, None]
    V_all = tl.load(v + i_b64 * sv_b + i_hv * sv_h + o_n[:, None] * sv_t + o_v[None, :],
                    mask=m_n[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    b_all = tl.load(beta + i_b64 * sb_b + i_hv * sb_h + o_n * sb_t, mask=m_n, other=0.0).to(tl.float32)
    if RAW_GATES:  # β = sigmoid(b) in b's dtype, as the module computes it
        b_all = tl.where(m_n, gate_beta(b_all, beta.dtype.element_ty), 0.0)
    R = b_all[:, None] * (V_all - kS)
    o_acc = qS

    # right-looking: U_i = (I + A_ii)^{-1} R_i, then the rows below take A[:, i] U_i and every row P[:, i] U_i
    u_base = node_rows(u, i_b64, i_hv, T, HV, V)
    for i in range(0, NB):
        Y, A_col, P_col = Y_n, A_n, P_n
        Y_n, A_n, P_n = _solve_block(a_in, qk_in, pair_base, o_n, m_n, T, i + 1, NB, BT)
        t_c, m_c = lanes(i, BT, T)
        U_i = tl.dot(Y, R, input_precision="ieee")  # [BT, BV]
        tl.store(u_base + t_c[:, None] * (HV * V) + o_v[None, :], U_i, mask=m_c[:, None] & m_v[None, :])
        R -= tl.dot(A_col, U_i, input_precision="ieee")
        o_acc += tl.dot(P_col, U_i, input_precision="ieee")
    tl.store(node_rows(o, i_b64, i_hv, T, HV, V) + o_n[:, None] * (HV * V) + o_v[None, :],
             (o_acc * scale).to(o.dtype.element_ty), mask=m_n[:, None] & m_v[None, :])


def kda_tree_verify_triton(
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
    BV: int | None = None,
    BKW: int = 16,
    num_warps: int = 4,
    solve_warps: int = SOLVE_WARPS,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    pair_spread_max: float = PAIR_SPREAD_MAX,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of :func:`~weaver_kernels.kda_tree.naive.kda_tree_verify_ref` (same shapes and outputs) for
    gates already formed (``g [B, T, HV, K]``). ``BV``, ``solve_warps``: value columns (default :func:`solve_bv`) and
    warps per solve program; ``num_warps``: the prep's; ``BKW``: channels per step of the exact form of the wide
    channels (a [16, 16, BKW] product, a power of two ≥ 16). All dots are IEEE fp32. With
    ``A_log`` (HV entries) and ``dt_bias`` (HV·K), ``g`` and ``beta`` are the raw projections f and b and the kernels
    form the gates (:func:`~weaver_kernels.kda_tree.naive.kda_gates`' formula). ``pair_spread_max``: the widest Γ
    spread (nats) of a channel of a pair tile in the dots, added exactly past it; the default is the fp32-safe one,
    ±inf sends every channel one way (the tests' check of each)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if HV % H:
        raise ValueError(f"value heads ({HV}) must be a multiple of q/k heads ({H})")
    if T > MAX_NODES:
        raise ValueError(f"kda_tree_verify_triton supports at most {MAX_NODES} nodes, got {T}")
    if tuple(tree_mask.shape) != (T, T) or tuple(g.shape) != (B, T, HV, K):
        raise ValueError(f"tree_mask must be [{T}, {T}] and g [B, T, HV, K] = {(B, T, HV, K)}, got "
                         f"{tuple(tree_mask.shape)} and {tuple(g.shape)}")
    raw = A_log is not None
    if raw != (dt_bias is not None):
        raise ValueError("kda_tree_verify: A_log and dt_bias go together")
    if raw and (A_log.numel() != HV or dt_bias.numel() != HV * K):
        raise ValueError(f"kda_tree_verify: A_log must hold {HV} values (one per value head), dt_bias {HV * K} "
                         "(one per channel)")
    BK = max(16, next_pow2(K))
    if BKW < 16 or BKW & (BKW - 1) or BKW > BK:
        raise ValueError(f"BKW must be a power of two between 16 and {BK}, got {BKW}")
    scale = K**-0.5 if scale is None else float(scale)
    q, k, v, g = last_contig(q), last_contig(k), last_contig(v), last_contig(g)
    s0 = initial_state.contiguous()
    mask = tree_mask.contiguous()
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    o = torch.empty((B, T, HV, V), dtype=v.dtype, device=v.device)
    u = torch.empty((B, T, HV, V), dtype=torch.float32, device=v.device)
    gamma = torch.empty((B, T, HV, K), dtype=torch.float32, device=v.device)
    BV = solve_bv(T) if BV is None else BV
    NB = triton.cdiv(T, BT)
    tiles = NB * (NB + 1) // 2
    # (one allocation) the A / inverse tiles, the P tiles, and each prep program's slot for its dots' operands and Γ
    work = torch.empty(2 * B * HV * T * T + B * HV * tiles * 5 * BT * BK, dtype=torch.float32, device=v.device)
    a_t, qk_t = work[:B * HV * T * T], work[B * HV * T * T:2 * B * HV * T * T]
    scratch = work[2 * B * HV * T * T:]
    a_log, dt = (A_log.contiguous(), dt_bias.contiguous()) if raw else (s0, s0)
    strides = [x.stride(i) for x in (q, k) for i in range(3)]
    with launch_ctx(INTERPRET):
        _kda_prep_kernel[(tiles, B * HV)](
            q, k, g, beta, mask, gamma, a_log, dt, a_t, qk_t, scratch, T, *strides,
            g.stride(0), g.stride(1), g.stride(2), beta.stride(0), beta.stride(1), beta.stride(2),
            H=H, HV=HV, K=K, BK=BK, KD=min(32, BK), BKW=BKW, BT=BT, LOG2_BT=4, NB=NB,
            L2NORM=bool(use_qk_l2norm_in_kernel), RAW_GATES=raw, SPREAD_MAX=float(pair_spread_max),
            num_warps=num_warps, num_stages=1,
        )
        _kda_solve_kernel[(triton.cdiv(V, BV), B * HV)](
            q, k, v, beta, s0, gamma, a_t, qk_t, o, u, T, scale, *strides,
            v.stride(0), v.stride(1), v.stride(2), beta.stride(0), beta.stride(1), beta.stride(2),
            H=H, HV=HV, K=K, V=V, TP=max(BT, next_pow2(T)), BK=BK, KC=min(32, BK), BV=BV, BT=BT,
            L2NORM=bool(use_qk_l2norm_in_kernel), RAW_GATES=raw, num_warps=solve_warps, num_stages=1,
        )
    return o, u, gamma

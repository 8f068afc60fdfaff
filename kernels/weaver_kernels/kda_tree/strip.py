"""Tree KDA verify, strip form: two launches, and no serial chain of row blocks in the solve.

The system of docs/DESIGN.md §13, ``(I + A) U = R`` with ``R = β ⊙ (V − (K ⊙ e^Γ) S0)`` and
``O = scale · ((Q ⊙ e^Γ) S0 + C U)``, split at the row blocks of 16 nodes: ``I + A = D (I + N)`` with ``D`` the
block diagonal of ``I + A`` and ``N = D⁻¹ E`` (``E``: ``A`` left of the diagonal blocks), strictly block-lower, so
``N^NB = 0`` for NB row blocks and ``U = Σ_{m<NB} (−N)^m D⁻¹ R`` by Horner, ``U ← Y − N U`` NB − 1 times from
``Y = D⁻¹ R``. Everything but R is independent of S0 and of the value columns, so it is formed once per head:

1. strips (grid NB × B·HV): program ``b`` forms the gates of every node and ``Γ = M g`` (its pair scores' columns are
   every node), then its row block's pair scores against every node, ``A`` and ``C`` rows, the diagonal inverse
   ``P_b = (I + A_bb)⁻¹`` and ``N``'s rows ``P_b E_b``; it writes Γ of its rows, N, C and P_b (fp32 scratch).
2. solve (grid V / BV × B·HV): R, ``Y = D⁻¹ R``, the Horner dots, O: every row at once, no barrier, nothing reread.

Pair scores ``Σ_c k_ic k_jc e^{Γ_ic − Γ_jc}`` as dots with the decay folded into the operands against one reference
per row block and channel, the midpoint ``R_c`` of the block's Γ: row factors ``e^{Γ_ic − R_c}`` lie within
``e^{±S_c/2}`` (``S_c``: the block's spread) and an ancestor column's ``e^{R_c − Γ_jc}`` is at most ``e^{S_c/2}``
(an ancestor decayed less); non-ancestor columns are clamped there and masked after the dots. A channel with
``S_c ≤ SPREAD_MAX`` keeps every factor of an ancestor pair finite, and a factor underflows only where the pair's
decay is below ``e^{-23}`` (fp32's resolution); a wider channel (or a non-finite one) is added exactly on its own, an
outer product with the mask inside the exponent.
Why: the fused form's solve waits for each row block before the next (a diagonal inverse, a barrier and reloads per
block, per value block); here that chain is NB − 1 dots, and the diagonal inverses are formed once per head.
Why Γ of every node in every strip program: the columns need it, and a launch of its own costs more than the dot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gdn_tree.common import block_inverse, gate_beta
from ..triton_utils import INTERPRET, head_program, lanes, maximum, minimum, node_rows, rsum, state_tile
from ..utils import launch_ctx, next_pow2
from .fused import kda_gate, verify_inputs

MAX_NODES = 64  # the solve holds N, C and D⁻¹ ([T_pad, T_pad] each) in registers
# the widest Γ spread (nats) of a row block's channel in the dots: every factor of an ancestor pair within e^±64
SPREAD_MAX = 128.0


@triton.jit
def _mask_dot(M, x, SPLIT: tl.constexpr):
    """``M x`` for a 0/1 matrix M and fp32 x; with SPLIT as three bf16 dots: x split exactly into bf16 parts (8 bits
    each), so the sums keep fp32's precision on tensor cores (the interpreter's 16-bit dots are not exact: IEEE)."""
    if not SPLIT:
        return tl.dot(M.to(tl.float32), x, input_precision="ieee")
    m = M.to(tl.bfloat16)
    x1 = x.to(tl.bfloat16)
    r = x - x1.to(tl.float32)
    x2 = r.to(tl.bfloat16)
    x3 = (r - x2.to(tl.float32)).to(tl.bfloat16)
    return tl.dot(m, x1) + tl.dot(m, x2) + tl.dot(m, x3)


@triton.jit
def _strip_loads(g_base, k_base, q_base, o_n, m_n, t_r, m_r, kc, sg_t, sk_t, sq_t, K: tl.constexpr,
                 PKC: tl.constexpr):
    """One key-channel chunk's inputs of a strip program: gates of every node, keys of every node, its rows' keys
    and queries (fp32)."""
    o_kc = kc + tl.arange(0, PKC)
    m_nk = m_n[:, None] & (o_kc < K)[None, :]
    m_rk = m_r[:, None] & (o_kc < K)[None, :]
    g_c = tl.load(g_base + o_n[:, None] * sg_t + o_kc[None, :], mask=m_nk, other=0.0).to(tl.float32)
    k_c = tl.load(k_base + o_n[:, None] * sk_t + o_kc[None, :], mask=m_nk, other=0.0).to(tl.float32)
    k_r = tl.load(k_base + t_r[:, None] * sk_t + o_kc[None, :], mask=m_rk, other=0.0).to(tl.float32)
    q_r = tl.load(q_base + t_r[:, None] * sq_t + o_kc[None, :], mask=m_rk, other=0.0).to(tl.float32)
    return g_c, k_c, k_r, q_r


@triton.jit
def _kda_strip_kernel(
    q, k, g, beta, tmask, a_log, dt_bias, gamma, scratch, T,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sg_b, sg_t, sg_h, sb_b, sb_t, sb_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, TP: tl.constexpr, BT: tl.constexpr,
    LOG2_BT: tl.constexpr, L2NORM: tl.constexpr, RAW_GATES: tl.constexpr, SPREAD: tl.constexpr,
    PAIR_PREC: tl.constexpr, SPLIT: tl.constexpr, PKC: tl.constexpr,
):
    i_b64, i_hv, i_h = head_program(H, HV)
    b = tl.program_id(0)
    if b * BT < T:  # (a row block wholly past the nodes: the solve never reads its rows)
        o_n, m_n = lanes(0, TP, T)
        t_r, m_r = lanes(b, BT, T)
        k_base, q_base = k + i_b64 * sk_b + i_h * sk_h, q + i_b64 * sq_b + i_h * sq_h

        M_all = tl.load(tmask + o_n[:, None] * T + o_n[None, :], mask=m_n[:, None] & m_n[None, :], other=0)
        M_r = tl.load(tmask + t_r[:, None] * T + o_n[None, :], mask=m_r[:, None] & m_n[None, :], other=0)
        b_r = tl.load(beta + i_b64 * sb_b + i_hv * sb_h + t_r * sb_t, mask=m_r, other=0.0).to(tl.float32)
        if RAW_GATES:
            b_r = tl.where(m_r, gate_beta(b_r, beta.dtype.element_ty), 0.0)
        Mb = M_r != 0
        g_base = g + i_b64 * sg_b + i_hv * sg_h
        gm_rows = node_rows(gamma, i_b64, i_hv, T, HV, K) + t_r[:, None] * (HV * K)
        kk = tl.full([BT, TP], 0.0, tl.float32)
        qk = tl.full([BT, TP], 0.0, tl.float32)
        ss_c = tl.full([TP, PKC], 0.0, tl.float32)  # squares summed lane by lane, across lanes once at the end
        ss_k = tl.full([BT, PKC], 0.0, tl.float32)
        ss_q = tl.full([BT, PKC], 0.0, tl.float32)
        # PKC key channels at a time, the next chunk's loads issued before this chunk's work (latency hidden)
        nxt = _strip_loads(g_base, k_base, q_base, o_n, m_n, t_r, m_r, 0, sg_t, sk_t, sq_t, K, PKC)
        for kc in tl.static_range(0, BK, PKC):
            g_c, k_c, k_r, q_r = nxt
            if kc + PKC < BK:
                nxt = _strip_loads(g_base, k_base, q_base, o_n, m_n, t_r, m_r, kc + PKC, sg_t, sk_t, sq_t, K, PKC)
            o_kc = kc + tl.arange(0, PKC)
            m_kc = o_kc < K
            if RAW_GATES:
                g_c = tl.where(m_n[:, None] & m_kc[None, :], kda_gate(g_c, a_log, dt_bias, i_hv, o_kc, m_kc, K), 0.0)
            G_c = _mask_dot(M_all, g_c, SPLIT)  # Γ of every node [TP, PKC]
            G_r = _mask_dot(M_r, g_c, SPLIT)  # and of this block's rows (a dot: no row extraction from registers)
            tl.store(gm_rows + o_kc[None, :], G_r, mask=m_r[:, None] & m_kc[None, :])

            # the reference per channel: the midpoint of the block's Γ; a channel past SPREAD (or not finite) is wide
            hi = tl.reduce(tl.where(m_r[:, None], G_r, float("-inf")), 0, maximum)
            lo = tl.reduce(tl.where(m_r[:, None], G_r, float("inf")), 0, minimum)
            narrow = (hi - lo <= SPREAD) & m_kc  # (NaN compares false)
            ref = tl.where(narrow, 0.5 * (hi + lo), 0.0)
            x_r = m_r[:, None] & narrow[None, :]
            e_r = tl.exp(tl.where(x_r, G_r - ref[None, :], 0.0))
            x_c = m_n[:, None] & narrow[None, :]
            # an ancestor column's exponent is ≤ SPREAD / 2 already; the clamp keeps the others finite (masked later)
            e_c = tl.exp(tl.where(x_c, tl.minimum(ref[None, :] - G_c, 0.5 * SPREAD), 0.0))
            kT = tl.trans(tl.where(x_c, k_c * e_c, 0.0))  # [PKC, TP]
            kk += tl.dot(tl.where(x_r, k_r * e_r, 0.0), kT, input_precision=PAIR_PREC)  # [BT, TP]
            qk += tl.dot(tl.where(x_r, q_r * e_r, 0.0), kT, input_precision=PAIR_PREC)
            ss_c += k_c * k_c
            ss_k += k_r * k_r
            ss_q += q_r * q_r

            wide = m_kc & ~narrow
            for w in tl.static_range(kc, kc + PKC, 16):  # the wide channels, 16 to a bit mask, each exactly alone
                bits = rsum(tl.where(wide & (o_kc // 16 == w // 16), 1 << (o_kc % 16), 0), axis=0)
                if bits != 0:
                    for j in range(16):
                        if ((bits >> j) & 1) != 0:
                            one = o_kc[None, :] == w + j
                            G_r1 = rsum(tl.where(one, G_r, 0.0), axis=1)
                            kD = rsum(tl.where(one, k_c, 0.0), axis=1)[None, :] * tl.exp(
                                tl.where(Mb, G_r1[:, None] - rsum(tl.where(one, G_c, 0.0), axis=1)[None, :],
                                         float("-inf")))
                            kk += rsum(tl.where(one, k_r, 0.0), axis=1)[:, None] * kD
                            qk += rsum(tl.where(one, q_r, 0.0), axis=1)[:, None] * kD
        # the mask after the dots: a non-ancestor entry may be inf there
        kk = tl.where(Mb, kk, 0.0)
        qk = tl.where(Mb, qk, 0.0)
        if L2NORM:
            rk_c = tl.rsqrt(rsum(ss_c, axis=1) + 1e-6)
            kk = kk * tl.rsqrt(rsum(ss_k, axis=1) + 1e-6)[:, None] * rk_c[None, :]
            qk = qk * tl.rsqrt(rsum(ss_q, axis=1) + 1e-6)[:, None] * rk_c[None, :]
        A = tl.where(t_r[:, None] != o_n[None, :], b_r[:, None] * kk, 0.0)  # strict ancestors only

        o_r = tl.arange(0, BT)
        blk = o_n // BT == b
        A_d = tl.dot(A, tl.where(blk[:, None] & (o_n[:, None] - b * BT == o_r[None, :]), 1.0, 0.0),
                     input_precision="ieee")  # the diagonal block: a selection, exact
        P = block_inverse(A_d, 1.0, tl.full([BT], 1.0, tl.float32), BT, LOG2_BT, "ieee")
        N = tl.dot(P, tl.where(o_n[None, :] < b * BT, A, 0.0), input_precision="ieee")  # P_b E_b

        head = scratch + (i_b64 * HV + i_hv) * TP * TP  # scratch [3, B, HV, TP, TP]: N, C, D⁻¹
        stride = tl.num_programs(1) * TP * TP
        rows = t_r[:, None] * TP + o_n[None, :]
        tl.store(head + rows, N)
        tl.store(head + stride + rows, qk)
        tl.store(head + 2 * stride + t_r[:, None] * TP + t_r[None, :], P)


@triton.jit
def _solve_loads(gm_base, k_base, q_base, s_base, o_n, m_n, o_v, m_v, kc, sk_t, sq_t, HV: tl.constexpr,
                 K: tl.constexpr, V: tl.constexpr, BKC: tl.constexpr):
    """One key-channel chunk's inputs of a solve program: Γ, keys and queries of every node (fp32), and the chunk's
    rows of the committed state tile."""
    o_kc = kc + tl.arange(0, BKC)
    m_kc = o_kc < K
    m_nk = m_n[:, None] & m_kc[None, :]
    G = tl.load(gm_base + o_n[:, None] * (HV * K) + o_kc[None, :], mask=m_nk, other=0.0)
    k_n = tl.load(k_base + o_n[:, None] * sk_t + o_kc[None, :], mask=m_nk, other=0.0).to(tl.float32)
    q_n = tl.load(q_base + o_n[:, None] * sq_t + o_kc[None, :], mask=m_nk, other=0.0).to(tl.float32)
    S = tl.load(s_base + o_kc[:, None] * V + o_v[None, :], mask=m_kc[:, None] & m_v[None, :], other=0.0)
    return G, k_n, q_n, S.to(tl.float32)


@triton.jit
def _kda_strip_solve_kernel(
    q, k, v, beta, s0, gamma, scratch, o, u, T, scale,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sb_b, sb_t, sb_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, TP: tl.constexpr, BT: tl.constexpr,
    BKC: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, RAW_GATES: tl.constexpr, PREC: tl.constexpr,
):
    i_b64, i_hv, i_h = head_program(H, HV)
    o_v, m_v = lanes(tl.program_id(0), BV, V)
    o_n, m_n = lanes(0, TP, T)
    m_nv = m_n[:, None] & m_v[None, :]
    q_base, k_base = q + i_b64 * sq_b + i_h * sq_h, k + i_b64 * sk_b + i_h * sk_h
    gm_base = node_rows(gamma, i_b64, i_hv, T, HV, K)
    s_base = state_tile(s0, i_b64, i_hv, HV, K, V)
    mats = scratch + (i_b64 * HV + i_hv) * TP * TP + o_n[:, None] * TP + o_n[None, :]  # N, C, D⁻¹ of the strips
    stride = tl.num_programs(1) * TP * TP
    blk = o_n // BT
    v_n = tl.load(v + i_b64 * sv_b + i_hv * sv_h + o_n[:, None] * sv_t + o_v[None, :], mask=m_nv,
                  other=0.0).to(tl.float32)
    b_n = tl.load(beta + i_b64 * sb_b + i_hv * sb_h + o_n * sb_t, mask=m_n, other=0.0).to(tl.float32)
    if RAW_GATES:  # β = sigmoid(b) in b's dtype, as the module computes it
        b_n = tl.where(m_n, gate_beta(b_n, beta.dtype.element_ty), 0.0)
    # (K ⊙ e^Γ) S0 and (Q ⊙ e^Γ) S0, BKC channels at a time (three [T_pad, K] operands at once would spill)
    kS = tl.full([TP, BV], 0.0, tl.float32)
    qS = tl.full([TP, BV], 0.0, tl.float32)
    kss = tl.full([TP, BKC], 0.0, tl.float32)
    qss = tl.full([TP, BKC], 0.0, tl.float32)
    nxt = _solve_loads(gm_base, k_base, q_base, s_base, o_n, m_n, o_v, m_v, 0, sk_t, sq_t, HV, K, V, BKC)
    for kc in tl.static_range(0, K, BKC):  # the next chunk's loads issued before this chunk's dots
        G, k_n, q_n, S = nxt
        if kc + BKC < K:
            nxt = _solve_loads(gm_base, k_base, q_base, s_base, o_n, m_n, o_v, m_v, kc + BKC, sk_t, sq_t, HV, K, V,
                               BKC)
        else:  # the last chunk: the solve's matrices instead (not held through the loop: registers)
            Dinv = tl.load(mats + 2 * stride, mask=m_n[:, None] & (blk[:, None] == blk[None, :]), other=0.0)
            N = tl.load(mats, mask=m_n[:, None], other=0.0)
            C = tl.load(mats + stride, mask=m_n[:, None], other=0.0)
        eG = tl.exp(G)
        kS += tl.dot(k_n * eG, S, input_precision=PREC)
        qS += tl.dot(q_n * eG, S, input_precision=PREC)
        kss += k_n * k_n
        qss += q_n * q_n
    if L2NORM:
        kS = kS * tl.rsqrt(rsum(kss, axis=1) + 1e-6)[:, None]
        qS = qS * tl.rsqrt(rsum(qss, axis=1) + 1e-6)[:, None]
    Y = tl.dot(Dinv, b_n[:, None] * (v_n - kS), input_precision=PREC)
    U = Y
    for _ in tl.static_range(TP // BT - 1):  # U = Σ_{m<NB} (−N)^m Y
        U = Y - tl.dot(N, U, input_precision=PREC)
    tl.store(node_rows(u, i_b64, i_hv, T, HV, V) + o_n[:, None] * (HV * V) + o_v[None, :], U, mask=m_nv)
    o_acc = qS + tl.dot(C, U, input_precision=PREC)
    tl.store(node_rows(o, i_b64, i_hv, T, HV, V) + o_n[:, None] * (HV * V) + o_v[None, :],
             (o_acc * scale).to(o.dtype.element_ty), mask=m_nv)


def kda_tree_verify_strip(
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
    BV: int = 16,
    BKC: int | None = None,
    num_warps: int = 8,
    strip_warps: int = 8,
    pair_chunk: int = 32,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    spread_max: float = SPREAD_MAX,
    pair_precision: str = "ieee",
    precision: str = "tf32x3",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~.fused.kda_tree_verify_triton`'s contract (same arguments and outputs) in the strip form, for trees of
    at most :data:`MAX_NODES` nodes. ``BV``: value columns per solve program; ``BKC``: key channels per step of its
    state products (None: 32, or K's padded size below that); ``num_warps`` / ``strip_warps``: the solve's and the strips' warps; ``pair_chunk``: key
    channels per step of the strips' pair scores; ``spread_max``: the widest Γ
    spread (nats) of a row block's channel in the pair dots (±inf sends every channel one way: the tests' check of
    each); ``pair_precision`` / ``precision``: the ``input_precision`` of the pair-score dots and of the solve's."""
    BKC = BKC or min(32, max(16, next_pow2(q.shape[-1])))
    q, k, v, g, s0, mask, scale, raw, BK = verify_inputs(q, k, v, g, initial_state, tree_mask, scale, A_log, dt_bias,
                                                         BKC, MAX_NODES, "kda_tree_verify_strip")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    TP = max(16, next_pow2(T))
    o = torch.empty((B, T, HV, V), dtype=v.dtype, device=v.device)
    u = torch.empty((B, T, HV, V), dtype=torch.float32, device=v.device)
    gamma = torch.empty((B, T, HV, K), dtype=torch.float32, device=v.device)
    scratch = torch.empty((3, B, HV, TP, TP), dtype=torch.float32, device=v.device)  # N, C, D⁻¹
    a_log, dt = (A_log.contiguous(), dt_bias.contiguous()) if raw else (s0, s0)
    l2 = bool(use_qk_l2norm_in_kernel)
    sq, sk, sv, sg, sb = q.stride()[:3], k.stride()[:3], v.stride()[:3], g.stride()[:3], beta.stride()[:3]
    with launch_ctx(INTERPRET):
        _kda_strip_kernel[(TP // 16, B * HV)](
            q, k, g, beta, mask, a_log, dt, gamma, scratch, T, *sq, *sk, *sg, *sb, H=H, HV=HV, K=K, BK=BK, TP=TP,
            BT=16, LOG2_BT=4, L2NORM=l2, RAW_GATES=raw, SPREAD=float(spread_max), PAIR_PREC=pair_precision, SPLIT=not INTERPRET,
            PKC=min(pair_chunk, BK),
            num_warps=strip_warps, num_stages=1,
        )
        _kda_strip_solve_kernel[(triton.cdiv(V, BV), B * HV)](
            q, k, v, beta, s0, gamma, scratch, o, u, T, scale, *sq, *sk, *sv, *sb, H=H, HV=HV, K=K, V=V, TP=TP,
            BT=16, BKC=BKC, BV=BV, L2NORM=l2, RAW_GATES=raw, PREC=precision, num_warps=num_warps, num_stages=1,
        )
    return o, u, gamma

"""Tree KDA verify, strip form: two launches, and no serial chain of row blocks in the solve.

The system of docs/DESIGN.md §13, ``(I + A) U = R`` with ``R = β ⊙ (V − (K ⊙ e^Γ) S0)`` and
``O = scale · ((Q ⊙ e^Γ) S0 + C U)``, split at the row blocks of 16 nodes: ``I + A = D (I + N)`` with ``D`` the
block diagonal of ``I + A`` and ``N = D⁻¹ E`` (``E``: ``A`` left of the diagonal blocks), strictly block-lower, so
``N^NB = 0`` for NB row blocks and ``U = Σ_{m<NB} (−N)^m D⁻¹ R`` by Horner, ``U ← Y − N U`` NB − 1 times from
``Y = D⁻¹ R``. Everything but R is independent of S0 and of the value columns, so it is formed once per head:

1. strips (grid NB × B·HV): program ``b`` forms the gates of every node and ``Γ = M g`` (its pair scores' columns are
   every node), then its row block's pair scores against every node, ``A`` and ``C`` rows, the diagonal inverse
   ``P_b = (I + A_bb)⁻¹`` and ``N``'s rows ``P_b E_b``, and of ``Y = D⁻¹ R = D⁻¹ β ⊙ V − W S0`` the S0-free parts:
   ``P_b (β ⊙ V)`` and ``W = P_b (β r ⊙ K ⊙ e^Γ)`` of its rows, with ``r^q ⊙ Q ⊙ e^Γ`` (r: the l2 norms'
   reciprocals). It writes Γ of its rows and those (fp32 scratch).
2. solve (grid V / BV × B·HV): ``Y`` and ``(Q ⊙ e^Γ) S0`` as dots with S0, the Horner dots, O: every row at once, no
   barrier, nothing reread.

Pair scores ``Σ_c k_ic k_jc e^{Γ_ic − Γ_jc}`` as dots with the decay folded into the operands against one reference
per row block and channel, the midpoint ``m_c`` of the block's Γ: row factors ``e^{Γ_ic − m_c}`` lie within
``e^{±S_c/2}`` (``S_c``: the block's spread) and an ancestor column's ``e^{m_c − Γ_jc}`` is at most ``e^{S_c/2}``
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

MAX_NODES = 64  # the solve holds N and C ([T_pad, T_pad] each) in registers
# the widest Γ spread (nats) of a row block's channel in the dots: every factor of an ancestor pair within e^±64
SPREAD_MAX = 128.0


@triton.jit
def _mask_dot(M, x, PREC: tl.constexpr):
    """``M x`` for a 0/1 matrix M and fp32 x; with PREC "bf16x3" as three bf16 dots: x split exactly into bf16 parts
    (8 bits each), so the sums keep fp32's precision on tensor cores (the interpreter's 16-bit dots are not exact);
    else one dot at that ``input_precision``."""
    if PREC != "bf16x3":
        return tl.dot(M.to(tl.float32), x, input_precision=PREC)
    m = M.to(tl.bfloat16)
    x1 = x.to(tl.bfloat16)
    r = x - x1.to(tl.float32)
    x2 = r.to(tl.bfloat16)
    x3 = (r - x2.to(tl.float32)).to(tl.bfloat16)
    return tl.dot(m, x1) + tl.dot(m, x2) + tl.dot(m, x3)


@triton.jit
def _kda_strip_kernel(
    q, k, v, g, beta, tmask, a_log, dt_bias, gamma, mats, rows, T,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, sg_h, sb_b, sb_t, sb_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr,
    TP: tl.constexpr, BT: tl.constexpr, LOG2_BT: tl.constexpr, L2NORM: tl.constexpr, RAW_GATES: tl.constexpr,
    SPREAD: tl.constexpr, PAIR_PREC: tl.constexpr, GAMMA_PREC: tl.constexpr, INV_PREC: tl.constexpr,
):
    i_b64, i_hv, i_h = head_program(H, HV)
    b = tl.program_id(0)
    if b * BT < T:  # (a row block wholly past the nodes: the solve never reads its rows)
        o_k, m_k = lanes(0, BK, K)
        o_n, m_n = lanes(0, TP, T)
        t_r, m_r = lanes(b, BT, T)
        o_vf, m_vf = lanes(0, BVF, V)
        m_nk = m_n[:, None] & m_k[None, :]
        m_rk = m_r[:, None] & m_k[None, :]
        k_base, q_base = k + i_b64 * sk_b + i_h * sk_h, q + i_b64 * sq_b + i_h * sq_h

        # every load first: one round trip
        g_all = tl.load(g + i_b64 * sg_b + i_hv * sg_h + o_n[:, None] * sg_t + o_k[None, :], mask=m_nk,
                        other=0.0).to(tl.float32)
        M_all = tl.load(tmask + o_n[:, None] * T + o_n[None, :], mask=m_n[:, None] & m_n[None, :], other=0)
        M_r = tl.load(tmask + t_r[:, None] * T + o_n[None, :], mask=m_r[:, None] & m_n[None, :], other=0)
        k_all = tl.load(k_base + o_n[:, None] * sk_t + o_k[None, :], mask=m_nk, other=0.0).to(tl.float32)
        k_r = tl.load(k_base + t_r[:, None] * sk_t + o_k[None, :], mask=m_rk, other=0.0).to(tl.float32)
        q_r = tl.load(q_base + t_r[:, None] * sq_t + o_k[None, :], mask=m_rk, other=0.0).to(tl.float32)
        v_r = tl.load(v + i_b64 * sv_b + i_hv * sv_h + t_r[:, None] * sv_t + o_vf[None, :],
                      mask=m_r[:, None] & m_vf[None, :], other=0.0).to(tl.float32)
        b_r = tl.load(beta + i_b64 * sb_b + i_hv * sb_h + t_r * sb_t, mask=m_r, other=0.0).to(tl.float32)
        if RAW_GATES:
            g_all = tl.where(m_nk, kda_gate(g_all, a_log, dt_bias, i_hv, o_k, m_k, K), 0.0)
            b_r = tl.where(m_r, gate_beta(b_r, beta.dtype.element_ty), 0.0)

        G_all = _mask_dot(M_all, g_all, GAMMA_PREC)  # Γ of every node [TP, BK]
        # the rows' Γ selected from G_all by an exact 0/1 dot: a sum of their own would round apart on tensor cores,
        # which e^{Γ_i − Γ_j} amplifies by |Γ|; one row block (T ≤ 16) is every node
        G_r = G_all if TP == BT else _mask_dot(t_r[:, None] == o_n[None, :], G_all, GAMMA_PREC)
        tl.store(node_rows(gamma, i_b64, i_hv, T, HV, K) + t_r[:, None] * (HV * K) + o_k[None, :], G_r, mask=m_rk)

        # the reference per channel: the midpoint of the block's Γ; a channel past SPREAD (or not finite) is wide
        hi = tl.reduce(tl.where(m_r[:, None], G_r, float("-inf")), 0, maximum)
        lo = tl.reduce(tl.where(m_r[:, None], G_r, float("inf")), 0, minimum)
        narrow = (hi - lo <= SPREAD) & m_k  # (NaN compares false)
        ref = tl.where(narrow, 0.5 * (hi + lo), 0.0)
        x_r = m_r[:, None] & narrow[None, :]
        e_r = tl.exp(tl.where(x_r, G_r - ref[None, :], 0.0))
        x_c = m_n[:, None] & narrow[None, :]
        # an ancestor column's exponent is ≤ SPREAD / 2 already; the clamp keeps the others finite (masked later)
        e_c = tl.exp(tl.where(x_c, tl.minimum(ref[None, :] - G_all, 0.5 * SPREAD), 0.0))
        kT = tl.trans(tl.where(x_c, k_all * e_c, 0.0))  # [BK, TP]
        kk = tl.dot(tl.where(x_r, k_r * e_r, 0.0), kT, input_precision=PAIR_PREC)  # [BT, TP]
        qk = tl.dot(tl.where(x_r, q_r * e_r, 0.0), kT, input_precision=PAIR_PREC)

        Mb = M_r != 0
        wide = m_k & ~narrow
        if rsum(wide.to(tl.int32), axis=0) != 0:  # one reduction when (as usual) no channel is wide
            for w in tl.static_range(0, BK, 16):  # the wide channels, 16 to a bit mask, each exactly on its own
                bits = rsum(tl.where(wide & (o_k // 16 == w // 16), 1 << (o_k % 16), 0), axis=0)
                if bits != 0:
                    for j in range(16):
                        if ((bits >> j) & 1) != 0:
                            one = o_k[None, :] == w + j
                            G_r1 = rsum(tl.where(one, G_r, 0.0), axis=1)
                            kD = rsum(tl.where(one, k_all, 0.0), axis=1)[None, :] * tl.exp(
                                tl.where(Mb, G_r1[:, None] - rsum(tl.where(one, G_all, 0.0), axis=1)[None, :],
                                         float("-inf")))
                            kk += rsum(tl.where(one, k_r, 0.0), axis=1)[:, None] * kD
                            qk += rsum(tl.where(one, q_r, 0.0), axis=1)[:, None] * kD
        # the mask after the dots: a non-ancestor entry may be inf there
        kk = tl.where(Mb, kk, 0.0)
        qk = tl.where(Mb, qk, 0.0)
        rk_r = tl.full([BT], 1.0, tl.float32)
        rq_r = tl.full([BT], 1.0, tl.float32)
        if L2NORM:
            rk_c = tl.rsqrt(rsum(k_all * k_all, axis=1) + 1e-6)
            rk_r = tl.rsqrt(rsum(k_r * k_r, axis=1) + 1e-6)
            rq_r = tl.rsqrt(rsum(q_r * q_r, axis=1) + 1e-6)
            kk = kk * rk_r[:, None] * rk_c[None, :]
            qk = qk * rq_r[:, None] * rk_c[None, :]
        A = tl.where(t_r[:, None] != o_n[None, :], b_r[:, None] * kk, 0.0)  # strict ancestors only

        o_r = tl.arange(0, BT)
        blk = o_n // BT == b
        # the diagonal block: a selection, exact (one row block: A itself)
        A_d = A if TP == BT else tl.dot(A, tl.where(blk[:, None] & (o_n[:, None] - b * BT == o_r[None, :]), 1.0, 0.0),
                                        input_precision="ieee")
        P = block_inverse(A_d, 1.0, tl.full([BT], 1.0, tl.float32), BT, LOG2_BT, INV_PREC)
        # P_b E_b (one row block has no E_b, and the solve reads no N then)
        N = tl.full([BT, TP], 0.0, tl.float32) if TP == BT else tl.dot(P, tl.where(o_n[None, :] < b * BT, A, 0.0),
                                                                       input_precision=INV_PREC)
        eG_r = tl.exp(G_r)  # (K ⊙ e^Γ) of the rows; 0 past exp's range, where its product with S0 is below fp32's
        W = tl.dot(P, (b_r * rk_r)[:, None] * k_r * eG_r, input_precision=INV_PREC)
        Vd = tl.dot(P, b_r[:, None] * v_r, input_precision=INV_PREC)

        # mats [2, B, HV, TP, TP]: N, C; rows [B, HV, TP, 2·BK + BVF]: W, r^q ⊙ Q ⊙ e^Γ, P_b (β ⊙ V)
        head = mats + (i_b64 * HV + i_hv) * TP * TP
        at = t_r[:, None] * TP + o_n[None, :]
        tl.store(head + at, N)
        tl.store(head + tl.num_programs(1) * TP * TP + at, qk)
        row = rows + ((i_b64 * HV + i_hv) * TP + t_r[:, None]) * (2 * BK + BVF)
        tl.store(row + o_k[None, :], W)
        tl.store(row + BK + o_k[None, :], rq_r[:, None] * q_r * eG_r)
        tl.store(row + 2 * BK + o_vf[None, :], Vd)


@triton.jit
def _solve_loads(rows, o_n, m_n, o_v, m_v, s_base, kc, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                 RW: tl.constexpr, BKC: tl.constexpr):
    """One key-channel chunk's operands of a solve program: W and r^q ⊙ Q ⊙ e^Γ of every node, and the chunk's rows
    of the committed state tile."""
    o_kc = kc + tl.arange(0, BKC)
    m_kc = o_kc < K
    at = rows + o_n[:, None] * RW + o_kc[None, :]
    m_nk = m_n[:, None] & m_kc[None, :]
    W = tl.load(at, mask=m_nk, other=0.0)
    Qe = tl.load(at + BK, mask=m_nk, other=0.0)
    S = tl.load(s_base + o_kc[:, None] * V + o_v[None, :], mask=m_kc[:, None] & m_v[None, :], other=0.0)
    return W, Qe, S.to(tl.float32)


@triton.jit
def _kda_strip_solve_kernel(
    s0, mats, rows, o, u, T, scale,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, TP: tl.constexpr,
    BT: tl.constexpr, BKC: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    i_b64, i_hv, _ = head_program(HV, HV)
    o_v, m_v = lanes(tl.program_id(0), BV, V)
    o_n, m_n = lanes(0, TP, T)
    m_nv = m_n[:, None] & m_v[None, :]
    RW: tl.constexpr = 2 * BK + BVF
    head_rows = rows + (i_b64 * HV + i_hv) * TP * RW
    s_base = state_tile(s0, i_b64, i_hv, HV, K, V)
    Y = tl.load(head_rows + o_n[:, None] * RW + 2 * BK + o_v[None, :], mask=m_nv, other=0.0)  # D⁻¹ (β ⊙ V)
    # Y −= W S0 and (r^q ⊙ Q ⊙ e^Γ) S0, BKC channels at a time, the next chunk's loads issued before this one's dots
    qS = tl.full([TP, BV], 0.0, tl.float32)
    at = mats + (i_b64 * HV + i_hv) * TP * TP + o_n[:, None] * TP + o_n[None, :]
    nxt = _solve_loads(head_rows, o_n, m_n, o_v, m_v, s_base, 0, K, V, BK, RW, BKC)
    for kc in tl.static_range(0, K, BKC):
        W, Qe, S = nxt
        if kc + BKC < K:
            nxt = _solve_loads(head_rows, o_n, m_n, o_v, m_v, s_base, kc + BKC, K, V, BK, RW, BKC)
        else:  # the last chunk: the solve's matrices instead (not held through the loop: registers)
            N = tl.load(at, mask=m_n[:, None], other=0.0)
            C = tl.load(at + tl.num_programs(1) * TP * TP, mask=m_n[:, None], other=0.0)
        Y -= tl.dot(W, S, input_precision=PREC)
        qS += tl.dot(Qe, S, input_precision=PREC)
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
    BV: int = 32,
    BKC: int | None = None,
    num_warps: int = 4,
    strip_warps: int = 8,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    spread_max: float = SPREAD_MAX,
    pair_precision: str | None = None,
    precision: str = "tf32x3",
    inverse_precision: str = "ieee",
    gamma_precision: str = "bf16x3",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~.fused.kda_tree_verify_triton`'s contract (same arguments and outputs) in the strip form, for trees
    of at most :data:`MAX_NODES` nodes. ``BV``: value columns per solve program; ``BKC``: key channels per step of
    its state products (None: 64, or K's padded size below that); ``num_warps`` / ``strip_warps``: the solve's and
    the strips' warps; ``spread_max``: the widest Γ spread (nats) of a row block's channel in the pair dots (±inf
    sends every channel one way: the tests' check of each); ``pair_precision`` / ``precision``: the
    ``input_precision`` of the pair-score dots (None: IEEE fp32 FMA for one row block, T ≤ 16, where tf32x3's split
    operands spill registers; tf32x3 past it) and of the solve's (tf32x3: tensor cores, about fp32's accuracy);
    ``inverse_precision``: of the diagonal inverses and their products; ``gamma_precision``: of Γ's mask dots
    ("bf16x3": three exact bf16 parts)."""
    BKC = BKC or min(64, max(16, next_pow2(q.shape[-1])))
    q, k, v, g, s0, mask, scale, raw, BK = verify_inputs(q, k, v, g, initial_state, tree_mask, scale, A_log, dt_bias,
                                                         BKC, MAX_NODES, "kda_tree_verify_strip")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    TP = max(16, next_pow2(T))
    pair_precision = pair_precision or ("ieee" if TP == 16 else "tf32x3")
    BVF = max(16, next_pow2(V))
    o = torch.empty((B, T, HV, V), dtype=v.dtype, device=v.device)
    u = torch.empty((B, T, HV, V), dtype=torch.float32, device=v.device)
    gamma = torch.empty((B, T, HV, K), dtype=torch.float32, device=v.device)
    # one scratch allocation: N and C [2, B, HV, TP, TP], then the rows W, r^q Q e^Γ, D⁻¹ β V [B, HV, TP, 2·BK + BVF]
    n_mats = 2 * B * HV * TP * TP
    scratch = torch.empty(n_mats + B * HV * TP * (2 * BK + BVF), dtype=torch.float32, device=v.device)
    mats, rows = scratch[:n_mats], scratch[n_mats:]
    a_log, dt = (A_log.contiguous(), dt_bias.contiguous()) if raw else (s0, s0)
    sq, sk, sv, sg, sb = q.stride()[:3], k.stride()[:3], v.stride()[:3], g.stride()[:3], beta.stride()[:3]
    with launch_ctx(INTERPRET):
        _kda_strip_kernel[(TP // 16, B * HV)](
            q, k, v, g, beta, mask, a_log, dt, gamma, mats, rows, T, *sq, *sk, *sv, *sg, *sb, H=H, HV=HV, K=K, V=V,
            BK=BK, BVF=BVF, TP=TP, BT=16, LOG2_BT=4, L2NORM=bool(use_qk_l2norm_in_kernel), RAW_GATES=raw,
            SPREAD=float(spread_max), PAIR_PREC=pair_precision, GAMMA_PREC="ieee" if INTERPRET else gamma_precision,
            INV_PREC=inverse_precision, num_warps=strip_warps, num_stages=1,
        )
        _kda_strip_solve_kernel[(triton.cdiv(V, BV), B * HV)](
            s0, mats, rows, o, u, T, scale, HV=HV, K=K, V=V, BK=BK, BVF=BVF, TP=TP, BT=16, BKC=BKC, BV=BV,
            PREC=precision, num_warps=num_warps, num_stages=1,
        )
    return o, u, gamma

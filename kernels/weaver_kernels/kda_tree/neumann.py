"""Tree KDA verify, Neumann form: the row blocks' serial forward substitution replaced by d dense products.

The system of :mod:`.fused`, ``(I + A) U = R`` with ``R = β ⊙ (V − (K ⊙ e^Γ) S0)``, solved as the GDN Neumann form
does (:mod:`..gdn_tree.neumann`): ``N = −A`` is nilpotent, ``N^(d+1) = 0`` for a tree of depth d, so ``U = Σ_{m≤d}
N^m R`` by Horner, ``U ← R + N U`` d times, each a ``[T_pad, T_pad] · [T_pad, BV]`` dot; then ``O = scale · ((Q ⊙
e^Γ) S0 + C U)``. The per-channel decay only changes how N and C are formed: from :mod:`.fused`'s pair-score tiles
(decays folded into the dots per channel, wide channels exact), once per head. Three launches:

1. Γ (:mod:`.fused`'s ``_kda_gamma_kernel``);
2. coefficients (grid tiles × B·HV): ``N = −β_i r_i r_j (KKᵀ ⊙ D)_ij`` strictly below the diagonal of ancestors,
   ``C = r^q_i r_j (QKᵀ ⊙ D)_ij`` on ancestors-or-self (r: the l2 norms' reciprocals when the kernel normalises), zero
   elsewhere and past the nodes, into fp32 scratch; one program also writes the depth d (read off the mask);
3. solve (grid V / BV × B·HV): R, d Horner dots, O, every row at once.

Why: the fused form's solve is a chain of row blocks, each waiting for the one before (a diagonal inverse, a barrier
and reloads per block); here the chain is d dots of the whole tree. Meant for the shallow trees of block drafters:
on long chains (d near T) the GDN form lost to its row blocks (BENCHMARKS.md, Kernels); timed, this one is level
with or slower than the fused form (docs/history/benchmarks-log.md, Tree KDA); the ops take the strip form or the
fused one. T ≤ ``MAX_NODES`` (the coefficient matrix per program).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gdn_tree.common import gate_beta
from ..triton_utils import INTERPRET, head_program, lanes, node_rows, rsum, state_tile, tree_depth
from ..utils import launch_ctx, next_pow2
from .fused import PAIR_SPREAD_MAX, _kda_gamma_kernel, _pair_scores, verify_inputs

MAX_NODES = 128  # the solve holds N [T_pad, T_pad] in registers, as the GDN Neumann form does


@triton.jit
def _kda_coef_kernel(
    q, k, beta, tmask, gamma, coef, depth, T, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sb_b, sb_t, sb_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, BT: tl.constexpr,
    NB: tl.constexpr, TP: tl.constexpr, L2NORM: tl.constexpr, SPREAD_MAX: tl.constexpr, RAW_GATES: tl.constexpr,
):
    """Tile (row block i, column block c) of one value head's N and C (``program_id(0) = i · NB + c``): the pair
    scores of :mod:`.fused` for c ≤ i, zeros above the diagonal and past the nodes (the solve reads whole matrices,
    unmasked)."""
    i_b64, i_hv, i_h = head_program(H, HV)
    i, c = tl.program_id(0) // NB, tl.program_id(0) % NB
    t_r, m_r = lanes(i, BT, T)
    t_c, m_c = lanes(c, BT, T)
    base = coef + (i_b64 * HV + i_hv) * 2 * TP * TP + t_r[:, None] * TP + t_c[None, :]
    if (i == 0) & (c == 0) & (tl.program_id(1) == 0):  # the depth: the most ancestors of a node, less itself
        o_n, m_n = lanes(0, TP, T)
        M = tl.load(tmask + o_n[:, None] * T + o_n[None, :], mask=m_n[:, None] & m_n[None, :], other=0) != 0
        tl.store(depth, tree_depth(M))
    if (c <= i) & (i * BT < T):  # (a row block wholly past the nodes is padding: all its channels would look wide)
        k_base, q_base = k + i_b64 * sk_b + i_h * sk_h, q + i_b64 * sq_b + i_h * sq_h
        gm_base = node_rows(gamma, i_b64, i_hv, T, HV, K)
        kk, qk, ss, ss_k, ss_q = _pair_scores(k_base, q_base, gm_base, tmask, t_r, m_r, t_c, m_c, T, sk_t, sq_t,
                                  HV, K, BK, BKC, BT, SPREAD_MAX)
        b_r = tl.load(beta + i_b64 * sb_b + i_hv * sb_h + t_r * sb_t, mask=m_r, other=0.0).to(tl.float32)
        if RAW_GATES:
            b_r = tl.where(m_r, gate_beta(b_r, beta.dtype.element_ty), 0.0)
        if L2NORM:  # (the rows' and columns' squared norms come with the pair scores)
            rk_c = tl.rsqrt(ss + 1e-6)
            kk = kk * tl.rsqrt(ss_k + 1e-6)[:, None] * rk_c[None, :]
            qk = qk * tl.rsqrt(ss_q + 1e-6)[:, None] * rk_c[None, :]
        tl.store(base, tl.where(t_r[:, None] != t_c[None, :], -(b_r[:, None] * kk), 0.0))
        tl.store(base + TP * TP, qk)
    else:
        zero = tl.full([BT, BT], 0.0, tl.float32)
        tl.store(base, zero)
        tl.store(base + TP * TP, zero)


@triton.jit
def _kda_neumann_solve_kernel(
    q, k, v, beta, s0, coef, gamma, depth, o, u, T, scale,
    sq_b, sq_t, sq_h,
    sk_b, sk_t, sk_h,
    sv_b, sv_t, sv_h,
    sb_b, sb_t, sb_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, TP: tl.constexpr, BKC: tl.constexpr,
    BV: tl.constexpr, L2NORM: tl.constexpr, RAW_GATES: tl.constexpr, SOLVE_PREC: tl.constexpr,
):
    i_b64, i_hv, i_h = head_program(H, HV)
    o_v, m_v = lanes(tl.program_id(0), BV, V)
    o_n, m_n = lanes(0, TP, T)
    m_nv = m_n[:, None] & m_v[None, :]
    q_base, k_base = q + i_b64 * sq_b + i_h * sq_h, k + i_b64 * sk_b + i_h * sk_h
    v_base, b_base = v + i_b64 * sv_b + i_hv * sv_h, beta + i_b64 * sb_b + i_hv * sb_h  # (the gates are in Γ)
    gm_base = node_rows(gamma, i_b64, i_hv, T, HV, K)
    s_base = state_tile(s0, i_b64, i_hv, HV, K, V)
    # (K ⊙ e^Γ) S0 and (Q ⊙ e^Γ) S0, BKC channels at a time (three [T_pad, K] operands at once would spill)
    kS = tl.full([TP, BV], 0.0, tl.float32)
    qS = tl.full([TP, BV], 0.0, tl.float32)
    kss = tl.full([TP, BKC], 0.0, tl.float32)  # (summed across lanes once, after the loop)
    qss = tl.full([TP, BKC], 0.0, tl.float32)
    for kc in tl.static_range(0, K, BKC):
        o_kc = kc + tl.arange(0, BKC)
        m_kc = o_kc < K
        m_nk = m_n[:, None] & m_kc[None, :]
        eG = tl.exp(tl.load(gm_base + o_n[:, None] * (HV * K) + o_kc[None, :], mask=m_nk, other=0.0))
        k_n = tl.load(k_base + o_n[:, None] * sk_t + o_kc[None, :], mask=m_nk, other=0.0).to(tl.float32)
        q_n = tl.load(q_base + o_n[:, None] * sq_t + o_kc[None, :], mask=m_nk, other=0.0).to(tl.float32)
        S = tl.load(s_base + o_kc[:, None] * V + o_v[None, :], mask=m_kc[:, None] & m_v[None, :],
                    other=0.0).to(tl.float32)
        kS += tl.dot(k_n * eG, S, input_precision=SOLVE_PREC)
        qS += tl.dot(q_n * eG, S, input_precision=SOLVE_PREC)
        kss += k_n * k_n
        qss += q_n * q_n
    if L2NORM:
        kS = kS * tl.rsqrt(rsum(kss, axis=1) + 1e-6)[:, None]
        qS = qS * tl.rsqrt(rsum(qss, axis=1) + 1e-6)[:, None]
    b_n = tl.load(b_base + o_n * sb_t, mask=m_n, other=0.0).to(tl.float32)
    if RAW_GATES:  # β = sigmoid(b) in b's dtype, as the module computes it
        b_n = tl.where(m_n, gate_beta(b_n, beta.dtype.element_ty), 0.0)
    v_n = tl.load(v_base + o_n[:, None] * sv_t + o_v[None, :], mask=m_nv, other=0.0).to(tl.float32)
    R = b_n[:, None] * (v_n - kS)

    c_base = coef + (i_b64 * HV + i_hv) * 2 * TP * TP + o_n[:, None] * TP + o_n[None, :]
    N = tl.load(c_base)
    U = R
    for _ in range(0, tl.load(depth)):  # U = Σ_{m ≤ depth} N^m R
        U = R + tl.dot(N, U, input_precision=SOLVE_PREC)
    tl.store(node_rows(u, i_b64, i_hv, T, HV, V) + o_n[:, None] * (HV * V) + o_v[None, :], U, mask=m_nv)
    o_acc = qS + tl.dot(tl.load(c_base + TP * TP), U, input_precision=SOLVE_PREC)
    tl.store(node_rows(o, i_b64, i_hv, T, HV, V) + o_n[:, None] * (HV * V) + o_v[None, :],
             (o_acc * scale).to(o.dtype.element_ty), mask=m_nv)


def kda_tree_verify_neumann(
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
    BKC: int = 16,
    num_warps: int | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    pair_spread_max: float = PAIR_SPREAD_MAX,
    precision: str = "tf32x3",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~.fused.kda_tree_verify_triton`'s contract (same arguments and outputs) in the Neumann form, for trees
    of at most :data:`MAX_NODES` nodes. ``BV``, ``num_warps``: value columns per solve program and its warps (None:
    16 with 4 warps up to 64 nodes, 16 with 8 above); ``precision``: the solve's dots' ``input_precision``, by default
    ``"tf32x3"`` (tensor cores, about fp32's accuracy); ``"ieee"`` (FMA dots) spills registers at these tiles (ptxas
    for sm_90: ~5 KB at 64 nodes, none with tf32x3 at the defaults)."""
    q, k, v, g, s0, mask, scale, raw, BK = verify_inputs(q, k, v, g, initial_state, tree_mask, scale, A_log, dt_bias,
                                                         BKC, MAX_NODES, "kda_tree_verify_neumann")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    TP = max(16, next_pow2(T))
    NB = TP // 16
    BV = BV or 16
    solve_warps = num_warps or (4 if TP <= 64 else 8)
    o = torch.empty((B, T, HV, V), dtype=v.dtype, device=v.device)
    u = torch.empty((B, T, HV, V), dtype=torch.float32, device=v.device)
    gamma = torch.empty((B, T, HV, K), dtype=torch.float32, device=v.device)
    coef = torch.empty((B, HV, 2, TP, TP), dtype=torch.float32, device=v.device)
    depth = torch.empty((1,), dtype=torch.int32, device=v.device)
    a_log, dt = (A_log.contiguous(), dt_bias.contiguous()) if raw else (s0, s0)
    l2 = bool(use_qk_l2norm_in_kernel)
    sq, sk, sv, sb = q.stride()[:3], k.stride()[:3], v.stride()[:3], beta.stride()[:3]
    with launch_ctx(INTERPRET):
        _kda_gamma_kernel[(triton.cdiv(T, 16), B * HV)](g, mask, gamma, a_log, dt, T, *g.stride()[:3], H=H, HV=HV,
                                                        K=K, BK=BK, BT=16, RAW_GATES=raw, num_warps=4)
        _kda_coef_kernel[(NB * NB, B * HV)](
            q, k, beta, mask, gamma, coef, depth, T, *sq, *sk, *sb, H=H, HV=HV, K=K, BK=BK, BKC=BKC, BT=16, NB=NB,
            TP=TP, L2NORM=l2, SPREAD_MAX=float(pair_spread_max), RAW_GATES=raw, num_warps=4,
        )
        _kda_neumann_solve_kernel[(triton.cdiv(V, BV), B * HV)](
            q, k, v, beta, s0, coef, gamma, depth, o, u, T, scale, *sq, *sk, *sv, *sb, H=H, HV=HV, K=K, V=V, TP=TP,
            BKC=BKC, BV=BV, L2NORM=l2, RAW_GATES=raw, SOLVE_PREC=precision, num_warps=solve_warps, num_stages=1,
        )
    return o, u, gamma

"""Tree KDA verify in Triton, the exact-pairs form: three launches (Γ, exact pair tiles with the diagonal inverses,
the solve), or two with Γ formed in the pair programs. Not the ops' default: slower than :mod:`.fused` at T = 64 on an
H100 (73.4 / 73.1 µs verify + commit best-first / deep15 against 55.2 / 67.3; BENCHMARKS.md, issue #31), kept as a
measured alternative.

Same system as :mod:`.fused` (docs/DESIGN.md §13), ``(I + A) U = β ⊙ (V − (K ⊙ e^Γ) S0)`` and
``O = scale · ((Q ⊙ e^Γ) S0 + P U)``. The difference is how the pair scores ``Σ_c k_ic k_jc exp(Γ_ic − Γ_jc)`` are
formed: as exact sums, one exp per pair and channel, with the ancestor mask inside the exponent
(``exp(min(Γ_ic − Γ_jc, 0))`` on ancestor-or-self pairs, ``exp(−inf) = 0`` elsewhere). On a tree every kept exponent is
≤ 0 (the decays are ≤ 1; the min only clips fp32 rounding of Γ), so nothing overflows at any gate magnitude: no
reference rows, no wide-channel fallback, and every tile costs the same (no slowest tile decides the launch).

The pair launch also folds everything the solve would redo per value block into the tiles, once per head:
``kk_out`` holds ``β_i ‖k_i‖⁻¹ ‖k_j‖⁻¹ A_ij`` below the diagonal blocks and, on each diagonal block, the inverse
``(I + A_ii)^{-1}`` (:func:`..gdn_tree.common.block_inverse`); ``qk_out`` holds ``‖q_i‖⁻¹ ‖k_j‖⁻¹ P_ij``. So the solve's
chain per row block is ``U_i = Inv_i (rhs_i − Σ_{c<i} A_ic U_c)``: products only, no dependent squarings.

Launches: ``_kda_gamma_kernel`` of :mod:`.fused` (Γ; grid: row blocks × B·HV); ``_kda_exact_pairs_kernel`` (grid:
blocks² × B·HV, the upper half exits; ``BKC`` channels a step as a [16, 16, BKC] tile); ``_kda_exact_solve_kernel``
(grid: V / BV × B·HV; as the fused form's solve, U rows read back after a CTA barrier).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gdn_tree.common import block_inverse, gate_beta
from ..triton_utils import INTERPRET, head_inputs, head_program, lanes, node_rows, rsum, state_tile
from ..utils import launch_ctx
from .fused import _kda_gamma_kernel, kda_gate, verify_inputs

MAX_NODES = 256  # (the kernels' limit, as the fused form's)


@triton.jit
def _kda_exact_pairs_kernel(
    q, k, g, beta, tmask, gamma, kk_out, qk_out, a_log, dt_bias, T, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h,
    sg_b, sg_t, sg_h, sb_b, sb_t, sb_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, BT: tl.constexpr,
    NB: tl.constexpr, LOG2_BT: tl.constexpr, L2NORM: tl.constexpr, RAW_GATES: tl.constexpr,
    FUSE_GAMMA: tl.constexpr,
):
    """Tile (i, c), c ≤ i, of one value head (``program_id(0) = i · NB + c``): exact pair scores over the K channels,
    the norms and β folded in; on the diagonal the block's inverse ``(I + A_ii)^{-1}`` in place of A_ii. With
    ``FUSE_GAMMA`` the program forms Γ of its row and column blocks itself, chunk by chunk (ancestor-mask rows · g of
    the blocks up to it, the gates formed from the raw projections with ``RAW_GATES``), and the diagonal programs
    write Γ for the solve and the commit: no Γ launch."""
    i_b64, i_hv, i_h = head_program(H, HV)
    i, c = tl.program_id(0) // NB, tl.program_id(0) % NB
    if c <= i:
        t_r, m_r = lanes(i, BT, T)
        t_c, m_c = lanes(c, BT, T)
        k_base, q_base = k + i_b64 * sk_b + i_h * sk_h, q + i_b64 * sq_b + i_h * sq_h
        gm_base = node_rows(gamma, i_b64, i_hv, T, HV, K)
        M = tl.load(tmask + t_r[:, None] * T + t_c[None, :], mask=m_r[:, None] & m_c[None, :], other=0) != 0
        kk = tl.full([BT, BT], 0.0, tl.float32)
        qk = tl.full([BT, BT], 0.0, tl.float32)
        # [BT, BT, BKC] blocks of exps, BKC channels a step
        M3 = M[:, :, None]
        ss_c = tl.full([BT, BKC], 0.0, tl.float32)
        ss_k = tl.full([BT, BKC], 0.0, tl.float32)
        ss_q = tl.full([BT, BKC], 0.0, tl.float32)
        for kc in tl.static_range(0, BK, BKC):
            o_kc = kc + tl.arange(0, BKC)
            m_kc = o_kc < K
            m_rk = m_r[:, None] & m_kc[None, :]
            m_ck = m_c[:, None] & m_kc[None, :]
            if FUSE_GAMMA:
                g_base = g + i_b64 * sg_b + i_hv * sg_h
                G_r = tl.full([BT, BKC], 0.0, tl.float32)
                G_c = tl.full([BT, BKC], 0.0, tl.float32)
                for b in range(0, i + 1):  # ancestors come first: blocks past i hold none of these rows'
                    t_b, m_b = lanes(b, BT, T)
                    m_bk = m_b[:, None] & m_kc[None, :]
                    g_b = tl.load(g_base + t_b[:, None] * sg_t + o_kc[None, :], mask=m_bk,
                                  other=0.0).to(tl.float32)
                    if RAW_GATES:
                        g_b = tl.where(m_bk, kda_gate(g_b, a_log, dt_bias, i_hv, o_kc, m_kc, K), 0.0)
                    M_rb = tl.load(tmask + t_r[:, None] * T + t_b[None, :], mask=m_r[:, None] & m_b[None, :],
                                   other=0).to(tl.float32)
                    G_r += tl.dot(M_rb, g_b, input_precision="ieee")
                    if b <= c:
                        M_cb = tl.load(tmask + t_c[:, None] * T + t_b[None, :],
                                       mask=m_c[:, None] & m_b[None, :], other=0).to(tl.float32)
                        G_c += tl.dot(M_cb, g_b, input_precision="ieee")
                if c == i:
                    tl.store(gm_base + t_r[:, None] * (HV * K) + o_kc[None, :], G_r, mask=m_rk)
            else:
                G_r = tl.load(gm_base + t_r[:, None] * (HV * K) + o_kc[None, :], mask=m_rk, other=0.0)
                G_c = tl.load(gm_base + t_c[:, None] * (HV * K) + o_kc[None, :], mask=m_ck, other=0.0)
            k_r = tl.load(k_base + t_r[:, None] * sk_t + o_kc[None, :], mask=m_rk, other=0.0).to(tl.float32)
            q_r = tl.load(q_base + t_r[:, None] * sq_t + o_kc[None, :], mask=m_rk, other=0.0).to(tl.float32)
            k_c = tl.load(k_base + t_c[:, None] * sk_t + o_kc[None, :], mask=m_ck, other=0.0).to(tl.float32)
            # every kept exponent ≤ 0: the mask inside the exp, the min clips Γ's rounding on a path
            D = tl.exp(tl.where(M3, tl.minimum(G_r[:, None, :] - G_c[None, :, :], 0.0), float("-inf")))
            kD = k_c[None, :, :] * D  # [BT, BT, BKC]
            kk += rsum(k_r[:, None, :] * kD, axis=2)
            qk += rsum(q_r[:, None, :] * kD, axis=2)
            ss_c += k_c * k_c
            ss_k += k_r * k_r
            ss_q += q_r * q_r
        sc_c = rsum(ss_c, axis=1)
        sc_k = rsum(ss_k, axis=1)
        sc_q = rsum(ss_q, axis=1)
        b_r = tl.load(beta + i_b64 * sb_b + i_hv * sb_h + t_r * sb_t, mask=m_r, other=0.0).to(tl.float32)
        if RAW_GATES:  # β = sigmoid(b) in b's dtype, as the module computes it
            b_r = tl.where(m_r, gate_beta(b_r, beta.dtype.element_ty), 0.0)
        if L2NORM:
            rk_c = tl.rsqrt(sc_c + 1e-6)
            rk_r = tl.rsqrt(sc_k + 1e-6)
            rq_r = tl.rsqrt(sc_q + 1e-6)
            kk = kk * rk_r[:, None] * rk_c[None, :]
            qk = qk * rq_r[:, None] * rk_c[None, :]
        base = (i_b64 * HV + i_hv) * T * T + t_r[:, None] * T + t_c[None, :]
        m = m_r[:, None] & m_c[None, :]
        if c == i:
            kk = block_inverse(kk, 1.0, b_r, BT, LOG2_BT, "ieee")
        else:
            kk = kk * b_r[:, None]
        tl.store(kk_out + base, kk, mask=m)
        tl.store(qk_out + base, qk, mask=m)


@triton.jit
def _kda_exact_solve_kernel(
    q, k, v, beta, s0, o, u, gamma, kk_in, qk_in,
    T, scale,
    sq_b, sq_t, sq_h,
    sk_b, sk_t, sk_h,
    sv_b, sv_t, sv_h,
    sb_b, sb_t, sb_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, BT: tl.constexpr, RAW_GATES: tl.constexpr,
):
    """Value columns ``program_id(0)·BV …`` of one value head: the row blocks in order, ``U_i = Inv_i (rhs_i −
    Σ_{c<i} A_ic U_c)`` and ``O_i`` from the tiles of :func:`_kda_exact_pairs_kernel`."""
    i_b64, i_hv, i_h = head_program(H, HV)
    o_k, m_k = lanes(0, BK, K)
    o_v, m_v = lanes(tl.program_id(0), BV, V)
    o_r = tl.arange(0, BT)

    q_base, k_base, v_base, _, b_base = head_inputs(q, k, v, v, beta, i_b64, i_hv, i_h, sq_b, sq_h, sk_b, sk_h,
                                                    sv_b, sv_h, sv_b, sv_h, sb_b, sb_h)
    s_base = state_tile(s0, i_b64, i_hv, HV, K, V)
    o_base = node_rows(o, i_b64, i_hv, T, HV, V)
    u_base = node_rows(u, i_b64, i_hv, T, HV, V)
    gm_base = node_rows(gamma, i_b64, i_hv, T, HV, K)
    pair_base = (i_b64 * HV + i_hv) * T * T

    S = tl.load(s_base + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    m_vv = m_v[None, :]

    for i in range(0, (T + BT - 1) // BT):
        t_r = i * BT + o_r
        m_r = t_r < T
        m_rk = m_r[:, None] & m_k[None, :]
        m_rv = m_r[:, None] & m_vv
        G_i = tl.load(gm_base + t_r[:, None] * (HV * K) + o_k[None, :], mask=m_rk, other=0.0)
        k_i = tl.load(k_base + t_r[:, None] * sk_t + o_k[None, :], mask=m_rk, other=0.0).to(tl.float32)
        q_i = tl.load(q_base + t_r[:, None] * sq_t + o_k[None, :], mask=m_rk, other=0.0).to(tl.float32)
        v_i = tl.load(v_base + t_r[:, None] * sv_t + o_v[None, :], mask=m_rv, other=0.0).to(tl.float32)
        b_i = tl.load(b_base + t_r * sb_t, mask=m_r, other=0.0).to(tl.float32)
        if RAW_GATES:
            b_i = tl.where(m_r, gate_beta(b_i, beta.dtype.element_ty), 0.0)
        rk_i = tl.full([BT], 1.0, tl.float32)
        rq_i = tl.full([BT], 1.0, tl.float32)
        if L2NORM:
            rk_i = tl.rsqrt(rsum(k_i * k_i, axis=1) + 1e-6)
            rq_i = tl.rsqrt(rsum(q_i * q_i, axis=1) + 1e-6)
        eG = tl.exp(G_i)
        rhs = b_i[:, None] * (v_i - rk_i[:, None] * tl.dot(k_i * eG, S, input_precision="ieee"))
        o_acc = rq_i[:, None] * tl.dot(q_i * eG, S, input_precision="ieee")
        for c in range(0, i):
            t_c = c * BT + o_r
            m_c = t_c < T
            pair = pair_base + t_r[:, None] * T + t_c[None, :]
            kk = tl.load(kk_in + pair, mask=m_r[:, None] & m_c[None, :], other=0.0)
            qk = tl.load(qk_in + pair, mask=m_r[:, None] & m_c[None, :], other=0.0)
            U_c = tl.load(u_base + t_c[:, None] * (HV * V) + o_v[None, :], mask=m_c[:, None] & m_vv, other=0.0)
            rhs -= tl.dot(kk, U_c, input_precision="ieee")
            o_acc += tl.dot(qk, U_c, input_precision="ieee")
        pair = pair_base + t_r[:, None] * T + t_r[None, :]
        inv = tl.load(kk_in + pair, mask=m_r[:, None] & m_r[None, :], other=0.0)
        qk = tl.load(qk_in + pair, mask=m_r[:, None] & m_r[None, :], other=0.0)
        U_i = tl.dot(inv, rhs, input_precision="ieee")
        tl.store(u_base + t_r[:, None] * (HV * V) + o_v[None, :], U_i, mask=m_rv)
        o_acc += tl.dot(qk, U_i, input_precision="ieee")
        tl.store(o_base + t_r[:, None] * (HV * V) + o_v[None, :], (o_acc * scale).to(o.dtype.element_ty), mask=m_rv)
        tl.debug_barrier()  # this program's u rows are read back by later blocks: order the stores first


def kda_tree_verify_exact(
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
    BKC: int = 16,
    pair_warps: int = 8,
    num_warps: int = 4,
    fuse_gamma: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of :func:`~weaver_kernels.kda_tree.naive.kda_tree_verify_ref` (same shapes and outputs), the
    exact-pairs form. ``BV``: value columns per solve program; ``BKC``: key channels per step of a pair tile (a
    [16, 16, BKC] block of exps); ``pair_warps``: the pair launch's warps, ``num_warps`` the Γ and solve launches'.
    ``fuse_gamma``: Γ formed in the pair programs (two launches) rather than a launch of its own (three).
    ``A_log`` / ``dt_bias``: raw gates as in :func:`.fused.kda_tree_verify_triton`."""
    BKC = min(BKC, max(16, triton.next_power_of_2(q.shape[-1])))  # (a chunk no wider than the padded channels)
    q, k, v, g, s0, mask, scale, raw, BK = verify_inputs(q, k, v, g, initial_state, tree_mask, scale, A_log, dt_bias,
                                                         BKC, MAX_NODES, "kda_tree_verify_exact")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = torch.empty((B, T, HV, V), dtype=v.dtype, device=v.device)
    u = torch.empty((B, T, HV, V), dtype=torch.float32, device=v.device)
    gamma = torch.empty((B, T, HV, K), dtype=torch.float32, device=v.device)
    kk, qk = torch.empty((2, B, HV, T, T), dtype=torch.float32, device=v.device)
    NB = triton.cdiv(T, 16)
    a_log, dt = (A_log.contiguous(), dt_bias.contiguous()) if raw else (s0, s0)
    l2 = bool(use_qk_l2norm_in_kernel)
    with launch_ctx(INTERPRET):
        if not fuse_gamma:
            _kda_gamma_kernel[(NB, B * HV)](g, mask, gamma, a_log, dt, T, g.stride(0), g.stride(1), g.stride(2),
                                            H=H, HV=HV, K=K, BK=BK, BT=16, RAW_GATES=raw, num_warps=num_warps)
        _kda_exact_pairs_kernel[(NB * NB, B * HV)](
            q, k, g, beta, mask, gamma, kk, qk, a_log, dt, T, q.stride(0), q.stride(1), q.stride(2), k.stride(0),
            k.stride(1), k.stride(2), g.stride(0), g.stride(1), g.stride(2), beta.stride(0), beta.stride(1),
            beta.stride(2),
            H=H, HV=HV, K=K, BK=BK, BKC=BKC, BT=16, NB=NB, LOG2_BT=4, L2NORM=l2, RAW_GATES=raw,
            FUSE_GAMMA=bool(fuse_gamma), num_warps=pair_warps,
        )
        _kda_exact_solve_kernel[(triton.cdiv(V, BV), B * HV)](
            q, k, v, beta, s0, o, u, gamma, kk, qk, T, scale,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            beta.stride(0), beta.stride(1), beta.stride(2),
            H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, L2NORM=l2, BT=16, RAW_GATES=raw,
            num_warps=num_warps, num_stages=1,
        )
    return o, u, gamma

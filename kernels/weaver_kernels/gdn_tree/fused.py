"""Fused tree GDN verify: one launch, left-looking blockwise forward substitution; writes no state.

The masked unit-lower-triangular solve ``(I + A) U = R`` (:mod:`.chunk`) runs over row blocks of BT=16 nodes (fla's
``solve_tril`` idea, left-looking): for block i, ``U_i = (I + A_ii)^{-1} (rhs_i − A_{i,<i} U_{<i})``. The 16×16
diagonal inverse is exact for a strictly lower ``A_ii`` (nilpotent, N^16 = 0) as the product
``(I−A)(I+A²)(I+A⁴)(I+A⁸)``: six tiny fp32 dots instead of 16 dependent row steps. Solved rows of U go straight to
the ``u`` output, which doubles as the scratch the later blocks read back (same program, after a CTA barrier).
Everything that does not depend on U (K S0, Q S0, the [16, T] score rows, Γ, D) is fused in the same pass, so a
head's S0 tile is read once and no [T, T] matrix ever touches memory.

Grid: (V / BV, B·HV). Each program owns one value head and BV value columns and holds its S0 tile ([K, BV]) in
registers; earlier blocks are visited BC (≤ 64) columns at a time. The per-block Γ reduction and the read-back of U
use full-width [16, T_pad] / [T_pad, BV] tiles, and the serial chain of ⌈T/16⌉ row blocks is latency-bound, so time
grows linearly with the number of blocks (``BT`` = 32 or 64: fewer, larger blocks at the cost of a larger inverse).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..triton_utils import INTERPRET, head_inputs, head_program, lanes, node_rows, rsum, state_tile
from ..utils import launch_ctx
from .common import block_inverse, gate_beta, gate_decay, root_step

# Candidate configs (tests exercise all of them; scripts/bench_kernels.py can sweep them). The default is one measured
# config, not an autotuner sweep: the autotuner times eager launches, which at these sizes mostly measures host launch
# overhead (BENCHMARKS.md, Kernels). BV=32 / 4 warps runs the Qwen3.6-27B shape's 192 programs in one wave.
# num_stages=1 on purpose: the loop reads back rows of `u` that the same program stored one iteration earlier;
# a software-pipelined (prefetched) load could be issued before that store and its barrier.
_VERIFY_CANDIDATES = [
    triton.Config({"BV": bv}, num_warps=w, num_stages=1) for bv, w in ((16, 4), (32, 4), (32, 8), (64, 8))
]
if INTERPRET:
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
    i_b64, i_hv, i_h = head_program(H, HV)
    o_k, m_k = lanes(0, BK, K)
    o_v, m_v = lanes(tl.program_id(0), BV, V)
    o_n, m_n = lanes(0, TP, T)
    o_r = tl.arange(0, BT)
    o_c = tl.arange(0, BC)

    q_base, k_base, v_base, g_base, b_base = head_inputs(q, k, v, g, beta, i_b64, i_hv, i_h, sq_b, sq_h, sk_b, sk_h,
                                                         sv_b, sv_h, sg_b, sg_h, sb_b, sb_h)
    s_base = state_tile(s0, i_b64, i_hv, HV, K, V)
    o_base = node_rows(o, i_b64, i_hv, T, HV, V)
    u_base = node_rows(u, i_b64, i_hv, T, HV, V)
    gm_base = node_rows(gamma, i_b64, i_hv, T, HV, 1)

    g_all = tl.load(g_base + o_n * sg_t, mask=m_n, other=0.0).to(tl.float32)
    if RAW_GATES:  # g holds the raw projection a (beta: b, per block below)
        g_all = tl.where(m_n, gate_decay(g_all, a_log, dt_bias, i_hv), 0.0)
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
        missing = rsum(tl.where(col0 != 0, 0, 1), axis=0)  # nodes that do not descend from node 0
        rooted = missing == 0
        g0 = rsum(tl.where(o_n == 0, g_all, 0.0), axis=0)
        q0, k0, e0, u0 = root_step(q_base, k_base, v_base, b_base, o_k, m_k, o_v, m_v, S, g0,
                                    beta.dtype.element_ty, L2NORM, RAW_GATES)
        S_root = e0 * S + k0[:, None] * u0[None, :]
        o0 = rsum(q0[:, None] * S_root, axis=0) * scale
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
            b_i = tl.where(m_r, gate_beta(b_i, beta.dtype.element_ty), 0.0)

        # Γ of this block's rows (path sums: ancestor-mask row · g). Every program writes the same values to
        # `gamma`; later blocks read earlier rows back from there (after the barrier at the loop end).
        G_i = rsum(tl.where(M_i != 0, g_all[None, :], 0.0), axis=1)
        tl.store(gm_base + t_r * HV, G_i, mask=m_r)
        eG = tl.exp(G_i - g_root)

        kS = tl.dot(k_i.to(tl.float32), S, input_precision=DOT_PREC)  # [BT, BV]
        qS = tl.dot(q_i.to(tl.float32), S, input_precision=DOT_PREC)
        if L2NORM:
            kf_i = k_i.to(tl.float32)
            qf_i = q_i.to(tl.float32)
            rk_i = tl.rsqrt(rsum(kf_i * kf_i, axis=1) + 1e-6)
            rq_i = tl.rsqrt(rsum(qf_i * qf_i, axis=1) + 1e-6)
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
                rk_c = tl.rsqrt(rsum(kf_c * kf_c, axis=0) + 1e-6)
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
        P = block_inverse(kk_d, D_d, b_i, BT, LOG2_BT, INV_PREC)
        U_i = tl.dot(P, rhs, input_precision=INV_PREC)
        tl.store(u_base + t_r[:, None] * (HV * V) + o_v[None, :], U_i, mask=m_r[:, None] & m_vv)

        o_acc += tl.dot(qk_d * D_d, U_i, input_precision=DOT_PREC)
        tl.store(o_base + t_r[:, None] * (HV * V) + o_v[None, :], (o_acc * scale).to(o.dtype.element_ty),
                 mask=m_r[:, None] & m_vv)
        # this program's u rows (and gamma rows) are read back by later blocks: order the stores first
        tl.debug_barrier()


_gdn_tree_verify_autotuned = triton.autotune(
    configs=_VERIFY_CANDIDATES if not INTERPRET else _VERIFY_CONFIGS,
    key=["TP", "K", "V", "H", "HV", "L2NORM", "DOT_PREC", "DOT_F32", "INV_PREC", "PEEL"],
)(_gdn_tree_verify_kernel)


def verify_fused(args, common, raw, inverse_precision, BV, num_warps, autotune, peel):
    """Launch the fused verify on :func:`~.chunk.gdn_tree_verify_triton`'s ``args`` and ``common`` constexprs: at
    ``BV``/``num_warps`` when given, else the measured config, or the candidates' autotuner with ``autotune``."""
    q, v = args[0], args[2]
    B, HV, V = q.shape[0], v.shape[2], v.shape[3]
    if BV is None and (INTERPRET or not autotune):
        BV = _VERIFY_CONFIGS[0].kwargs["BV"]
        num_warps = _VERIFY_CONFIGS[0].num_warps
    with launch_ctx(INTERPRET):
        if BV is None:
            grid = lambda meta: (triton.cdiv(V, meta["BV"]), B * HV)  # noqa: E731
            _gdn_tree_verify_autotuned[grid](*args, **common, INV_PREC=inverse_precision, RAW_GATES=raw, PEEL=peel)
        else:
            _gdn_tree_verify_kernel[(triton.cdiv(V, BV), B * HV)](
                *args, **common, BV=BV, num_warps=num_warps, num_stages=1, INV_PREC=inverse_precision,
                RAW_GATES=raw, PEEL=peel,
            )

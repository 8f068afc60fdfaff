"""Tree KDA verify in Triton: three launches, left-looking blockwise forward substitution; writes no state.

The system of docs/DESIGN.md §13, ``(I + A) U = β ⊙ (V − (K ⊙ e^Γ) S0)`` and ``O = scale · ((Q ⊙ e^Γ) S0 + P U)``,
solved over row blocks of 16 nodes as the fused GDN form does (:mod:`..gdn_tree.fused`): for block i,
``U_i = (I + A_ii)^{-1} (rhs_i − A_{i,<i} U_{<i})``, the diagonal inverse by the nilpotent product of
:func:`..gdn_tree.common.block_inverse`. The difference is the decay: per channel, so the pair scores of ``A`` and
``P``, ``Σ_c k_ic k_jc exp(Γ_ic − Γ_jc)``, are not one matmul of decayed keys. Each [16, 16] tile folds the decay into
the operands against a reference per channel, ``R_c = max_{i ∈ rows} Γ_ic``: ``(K_I ⊙ e^{Γ_I − R}) (K_J ⊙ e^{R −
Γ_J})ᵀ``, IEEE fp32 dots (as the GDN forms' fp32 K·Kᵀ), the ancestor mask after them: the same scores up to rounding
for the channels whose spread ``R_c − min_{j ∈ cols} Γ_jc`` stays within ``PAIR_SPREAD_MAX`` (both factors finite).
A channel past it is zeroed in those operands and added exactly on its own, a [16, 16] outer product with the mask
inside the exp (the overflow-safe form of §13: every exponent kept is ≤ 0).
Why dots: an exp per pair and channel made this verify slow; the dots need an exp per node and channel.
Why per channel: a launch waits for its slowest tile, so a whole tile on the exact form was the critical path.

Launches: ``_kda_gamma_kernel`` writes Γ (grid: row blocks × B·HV); ``_kda_pairs_kernel`` the pair-score tiles of
every row block and earlier-or-same column block, once per head (grid: blocks² × B·HV; the upper half exits);
``_kda_tree_verify_kernel`` (grid: V / BV × B·HV) the solve: each program owns one value head and BV value columns,
holds its S0 tile ([K, BV]) in registers and reads the tiles, so the value blocks of a head no longer each form the
same scores. Solved U rows go to the ``u`` output, which the later blocks of the same program read back after a CTA
barrier.
Why Γ has a launch of its own: each pairs program would recompute and re-gate Γ of its row and column blocks
(several times its tile's dot work) and the wide channels read Γ from memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gdn_tree.common import block_inverse, gate_beta, last_contig
from ..triton_utils import (
    INTERPRET,
    head_inputs,
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


@triton.jit
def kda_gate(f, a_log, dt_bias, i_hv, o_k, m_k, K: tl.constexpr):
    """KimiLinear's g of value head ``i_hv`` from raw projections ``f [N, BK]``: −exp(A_log) · softplus(f + dt_bias)
    with transformers' softplus, log(1 + exp(x)) up to 20 and x above (:func:`..kda_tree.naive.kda_gates`)."""
    x = f + tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)[None, :]
    return -tl.exp(tl.load(a_log + i_hv).to(tl.float32)) * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))


@triton.jit
def _pair_scores(k_base, q_base, gm_base, tmask, t_r, m_r, t_c, m_c, T, sk_t, sq_t,
                 HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, BT: tl.constexpr,
                 SPREAD_MAX: tl.constexpr):
    """Raw ``Σ_c k_ic k_jc D_ijc`` and ``Σ_c q_ic k_jc D_ijc`` ([BT, BT]) of rows t_r against columns t_c, with
    ``D_ijc = exp(Γ_ic − Γ_jc)`` on ancestor-or-self pairs and 0 elsewhere, the columns' ‖k_j‖² and the rows'
    ‖k_i‖², ‖q_i‖² (for the l2 norms; unused results cost nothing), over the K channels BKC at a time. A channel whose spread ``S_c = R_c − min_{j ∈ cols} Γ_jc`` (``R_c =
    max_{i ∈ rows} Γ_ic``) is within ``SPREAD_MAX`` goes into dots with the decay folded into the operands,
    ``e^{Γ_ic − Γ_jc} = e^{Γ_ic − R_c} · e^{R_c − Γ_jc}`` (row factor ≤ 1, column factor ≤ e^{S_c}); the mask after
    the dots (a select). A wider channel (or one whose spread is not finite) is zeroed in those operands and added
    exactly on its own: a [BT, BT] outer product with the mask inside the exp (every exponent kept ≤ 0 on a tree),
    behind a scalar test of a bit mask of the wide channels, so narrow channels cost nothing there."""
    M = tl.load(tmask + t_r[:, None] * T + t_c[None, :], mask=m_r[:, None] & m_c[None, :], other=0) != 0
    kk = tl.full([BT, BT], 0.0, tl.float32)
    qk = tl.full([BT, BT], 0.0, tl.float32)
    # squares summed lane by lane, across lanes once after the loop (not a cross-lane sum per chunk)
    ss = tl.full([BT, BKC], 0.0, tl.float32)
    ss_k = tl.full([BT, BKC], 0.0, tl.float32)
    ss_q = tl.full([BT, BKC], 0.0, tl.float32)
    for kc in tl.static_range(0, BK, BKC):
        o_kc = kc + tl.arange(0, BKC)
        m_kc = o_kc < K
        m_rk = m_r[:, None] & m_kc[None, :]
        m_ck = m_c[:, None] & m_kc[None, :]
        # Γ of the real rows and columns only (every tile has some)
        G_r = tl.load(gm_base + t_r[:, None] * (HV * K) + o_kc[None, :], mask=m_rk, other=float("-inf"))
        G_c = tl.load(gm_base + t_c[:, None] * (HV * K) + o_kc[None, :], mask=m_ck, other=float("inf"))
        R = tl.reduce(G_r, 0, maximum)  # [BKC]
        narrow = (R - tl.reduce(G_c, 0, minimum) <= SPREAD_MAX) & (R > float("-inf")) & m_kc  # NaN, inf: wide
        wide = m_kc & ~narrow
        R = tl.where(narrow, R, 0.0)
        # the dots over the narrow channels; wide and padding ones at exponent 0 with their operands zeroed
        x_r = m_rk & narrow[None, :]
        x_c = m_ck & narrow[None, :]
        e_r = tl.exp(tl.where(x_r, G_r - R[None, :], 0.0))
        e_c = tl.exp(tl.where(x_c, R[None, :] - G_c, 0.0))
        k_r = tl.load(k_base + t_r[:, None] * sk_t + o_kc[None, :], mask=m_rk, other=0.0).to(tl.float32)
        q_r = tl.load(q_base + t_r[:, None] * sq_t + o_kc[None, :], mask=m_rk, other=0.0).to(tl.float32)
        k_c = tl.load(k_base + t_c[:, None] * sk_t + o_kc[None, :], mask=m_ck, other=0.0).to(tl.float32)
        kT = tl.trans(tl.where(x_c, k_c * e_c, 0.0))  # [BKC, BT]
        kk += tl.dot(tl.where(x_r, k_r * e_r, 0.0), kT, input_precision="ieee")
        qk += tl.dot(tl.where(x_r, q_r * e_r, 0.0), kT, input_precision="ieee")
        ss += k_c * k_c
        ss_k += k_r * k_r
        ss_q += q_r * q_r
        # the wide channels, 16 to a bit mask: each one's keys, queries and Γ from memory
        for w in tl.static_range(kc, kc + BKC, 16):
            bits = rsum(tl.where(wide & (o_kc // 16 == w // 16), 1 << (o_kc % 16), 0), axis=0)
            if bits != 0:
                for j in range(16):
                    if ((bits >> j) & 1) != 0:
                        ch = w + j
                        G_r1 = tl.load(gm_base + t_r * (HV * K) + ch, mask=m_r, other=0.0)
                        G_c1 = tl.load(gm_base + t_c * (HV * K) + ch, mask=m_c, other=0.0)
                        k_r1 = tl.load(k_base + t_r * sk_t + ch, mask=m_r, other=0.0).to(tl.float32)
                        q_r1 = tl.load(q_base + t_r * sq_t + ch, mask=m_r, other=0.0).to(tl.float32)
                        k_c1 = tl.load(k_base + t_c * sk_t + ch, mask=m_c, other=0.0).to(tl.float32)
                        kD = k_c1[None, :] * tl.exp(tl.where(M, G_r1[:, None] - G_c1[None, :], float("-inf")))
                        kk += k_r1[:, None] * kD
                        qk += q_r1[:, None] * kD
    # the mask after the dots: a non-ancestor entry's sum may be inf or NaN there (the wide terms are 0 off it)
    return (tl.where(M, kk, 0.0), tl.where(M, qk, 0.0), rsum(ss, axis=1), rsum(ss_k, axis=1),
            rsum(ss_q, axis=1))


@triton.jit
def _kda_gamma_kernel(
    g, tmask, gamma, a_log, dt_bias, T, sg_b, sg_t, sg_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, RAW_GATES: tl.constexpr,
):
    """Γ of row block ``program_id(0)`` of one value head: ancestor-mask rows · g over the column blocks up to it
    (ancestors come first); with ``RAW_GATES`` g holds the raw projection f and the gates are formed here."""
    i_b64, i_hv, _ = head_program(H, HV)
    i = tl.program_id(0)
    o_k, m_k = lanes(0, BK, K)
    t_r, m_r = lanes(i, BT, T)
    g_base = g + i_b64 * sg_b + i_hv * sg_h
    G_i = tl.full([BT, BK], 0.0, tl.float32)
    for c in range(0, i + 1):
        t_c, m_c = lanes(c, BT, T)
        M_c = tl.load(tmask + t_r[:, None] * T + t_c[None, :], mask=m_r[:, None] & m_c[None, :], other=0)
        m_ck = m_c[:, None] & m_k[None, :]
        g_c = tl.load(g_base + t_c[:, None] * sg_t + o_k[None, :], mask=m_ck, other=0.0).to(tl.float32)
        if RAW_GATES:
            g_c = tl.where(m_ck, kda_gate(g_c, a_log, dt_bias, i_hv, o_k, m_k, K), 0.0)
        G_i += tl.dot(M_c.to(tl.float32), g_c, input_precision="ieee")
    tl.store(node_rows(gamma, i_b64, i_hv, T, HV, K) + t_r[:, None] * (HV * K) + o_k[None, :], G_i,
             mask=m_r[:, None] & m_k[None, :])


@triton.jit
def _kda_pairs_kernel(
    q, k, tmask, gamma, kk_out, qk_out, T, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, BT: tl.constexpr,
    NB: tl.constexpr, L2NORM: tl.constexpr, SPREAD_MAX: tl.constexpr,
):
    """The pair scores of row block i and column block c ≤ i of one value head (``program_id(0) = i · NB + c``), once
    per head for every value block of the verify: ``[BT, BT]`` tiles of ``kk_out`` / ``qk_out`` (``[B, HV, T, T]``),
    columns already scaled by their keys' l2 norm."""
    i_b64, i_hv, i_h = head_program(H, HV)
    i, c = tl.program_id(0) // NB, tl.program_id(0) % NB
    if c <= i:
        t_r, m_r = lanes(i, BT, T)
        t_c, m_c = lanes(c, BT, T)
        k_base, q_base = k + i_b64 * sk_b + i_h * sk_h, q + i_b64 * sq_b + i_h * sq_h
        gm_base = node_rows(gamma, i_b64, i_hv, T, HV, K)
        kk, qk, ss, _, _ = _pair_scores(k_base, q_base, gm_base, tmask, t_r, m_r, t_c, m_c, T, sk_t, sq_t,
                                  HV, K, BK, BKC, BT, SPREAD_MAX)
        if L2NORM:
            rk_c = tl.rsqrt(ss + 1e-6)
            kk = kk * rk_c[None, :]
            qk = qk * rk_c[None, :]
        base = (i_b64 * HV + i_hv) * T * T + t_r[:, None] * T + t_c[None, :]
        m = m_r[:, None] & m_c[None, :]
        tl.store(kk_out + base, kk, mask=m)
        tl.store(qk_out + base, qk, mask=m)


@triton.jit
def _kda_tree_verify_kernel(
    q, k, v, g, beta, s0, o, u, gamma, kk_in, qk_in,
    T, scale,
    sq_b, sq_t, sq_h,
    sk_b, sk_t, sk_h,
    sv_b, sv_t, sv_h,
    sg_b, sg_t, sg_h,
    sb_b, sb_t, sb_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, BT: tl.constexpr,
    LOG2_BT: tl.constexpr, RAW_GATES: tl.constexpr,
):
    i_b64, i_hv, i_h = head_program(H, HV)
    o_k, m_k = lanes(0, BK, K)
    o_v, m_v = lanes(tl.program_id(0), BV, V)
    o_r = tl.arange(0, BT)

    q_base, k_base, v_base, g_base, b_base = head_inputs(q, k, v, g, beta, i_b64, i_hv, i_h, sq_b, sq_h, sk_b, sk_h,
                                                         sv_b, sv_h, sg_b, sg_h, sb_b, sb_h)
    s_base = state_tile(s0, i_b64, i_hv, HV, K, V)
    o_base = node_rows(o, i_b64, i_hv, T, HV, V)
    u_base = node_rows(u, i_b64, i_hv, T, HV, V)
    gm_base = node_rows(gamma, i_b64, i_hv, T, HV, K)  # Γ per channel
    pair_base = (i_b64 * HV + i_hv) * T * T  # this head's [T, T] pair-score tiles

    S = tl.load(s_base + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    m_vv = m_v[None, :]

    for i in range(0, (T + BT - 1) // BT):
        t_r = i * BT + o_r
        m_r = t_r < T
        m_rk = m_r[:, None] & m_k[None, :]
        m_rv = m_r[:, None] & m_vv

        G_i = tl.load(gm_base + t_r[:, None] * (HV * K) + o_k[None, :], mask=m_rk, other=0.0)  # (_kda_gamma_kernel)

        k_i = tl.load(k_base + t_r[:, None] * sk_t + o_k[None, :], mask=m_rk, other=0.0).to(tl.float32)
        q_i = tl.load(q_base + t_r[:, None] * sq_t + o_k[None, :], mask=m_rk, other=0.0).to(tl.float32)
        v_i = tl.load(v_base + t_r[:, None] * sv_t + o_v[None, :], mask=m_rv, other=0.0).to(tl.float32)
        b_i = tl.load(b_base + t_r * sb_t, mask=m_r, other=0.0).to(tl.float32)
        if RAW_GATES:  # β = sigmoid(b) in b's dtype, as the module computes it
            b_i = tl.where(m_r, gate_beta(b_i, beta.dtype.element_ty), 0.0)
        rk_i = tl.full([BT], 1.0, tl.float32)
        rq_i = tl.full([BT], 1.0, tl.float32)
        if L2NORM:
            rk_i = tl.rsqrt(rsum(k_i * k_i, axis=1) + 1e-6)
            rq_i = tl.rsqrt(rsum(q_i * q_i, axis=1) + 1e-6)
        eG = tl.exp(G_i)
        rhs = b_i[:, None] * (v_i - rk_i[:, None] * tl.dot(k_i * eG, S, input_precision="ieee"))
        o_acc = rq_i[:, None] * tl.dot(q_i * eG, S, input_precision="ieee")

        # ancestors in earlier blocks: rhs -= A[i, c] U[c]; o += P[i, c] U[c]
        for c in range(0, i):
            t_c = c * BT + o_r
            m_c = t_c < T
            pair = pair_base + t_r[:, None] * T + t_c[None, :]
            kk = tl.load(kk_in + pair, mask=m_r[:, None] & m_c[None, :], other=0.0)
            qk = tl.load(qk_in + pair, mask=m_r[:, None] & m_c[None, :], other=0.0)
            U_c = tl.load(u_base + t_c[:, None] * (HV * V) + o_v[None, :], mask=m_c[:, None] & m_vv, other=0.0)
            rhs -= tl.dot(kk * (rk_i * b_i)[:, None], U_c, input_precision="ieee")
            o_acc += tl.dot(qk * rq_i[:, None], U_c, input_precision="ieee")

        # diagonal block: ancestors inside the block (strict for A, inclusive for the output)
        pair = pair_base + t_r[:, None] * T + t_r[None, :]
        kk = tl.load(kk_in + pair, mask=m_r[:, None] & m_r[None, :], other=0.0)
        qk = tl.load(qk_in + pair, mask=m_r[:, None] & m_r[None, :], other=0.0)
        if L2NORM:  # (the columns' norms are in the tiles already)
            kk = kk * rk_i[:, None]
            qk = qk * rq_i[:, None]
        P = block_inverse(kk, 1.0, b_i, BT, LOG2_BT, "ieee")
        U_i = tl.dot(P, rhs, input_precision="ieee")
        tl.store(u_base + t_r[:, None] * (HV * V) + o_v[None, :], U_i, mask=m_rv)
        o_acc += tl.dot(qk, U_i, input_precision="ieee")
        tl.store(o_base + t_r[:, None] * (HV * V) + o_v[None, :], (o_acc * scale).to(o.dtype.element_ty), mask=m_rv)
        tl.debug_barrier()  # this program's u rows are read back by later blocks: order the stores first


def verify_inputs(q, k, v, g, initial_state, tree_mask, scale, A_log, dt_bias, BKC, max_nodes, name):
    """A verify launcher's checks and prepared inputs (both forms'): ``q, k, v, g`` (last dims contiguous), ``s0``,
    the mask as uint8, ``scale``, whether the gates are raw, ``BK``."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    if HV % H:
        raise ValueError(f"value heads ({HV}) must be a multiple of q/k heads ({H})")
    if T > max_nodes:
        raise ValueError(f"{name} supports at most {max_nodes} nodes, got {T}")
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
    if BKC < 16 or BKC & (BKC - 1) or BKC > BK:
        raise ValueError(f"BKC must be a power of two between 16 and {BK}, got {BKC}")
    mask = tree_mask.contiguous()
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    return (last_contig(q), last_contig(k), last_contig(v), last_contig(g), initial_state.contiguous(), mask,
            K**-0.5 if scale is None else float(scale), raw, BK)


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
    BV: int = 16,
    BKC: int = 16,
    num_warps: int = 4,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    pair_spread_max: float = PAIR_SPREAD_MAX,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of :func:`~weaver_kernels.kda_tree.naive.kda_tree_verify_ref` (same shapes and outputs) for
    gates already formed (``g [B, T, HV, K]``). ``BV``: value columns per program; ``BKC``: key channels per step of
    the pairwise scores (a [16, BKC] · [BKC, 16] dot; a channel past ``pair_spread_max`` adds a [16, 16] outer product
    of its own). All dots are IEEE fp32. With ``A_log`` (HV entries) and ``dt_bias`` (HV·K),
    ``g`` and ``beta`` are the raw projections f and b and the kernel forms the gates
    (:func:`~weaver_kernels.kda_tree.naive.kda_gates`' formula). ``pair_spread_max``: the widest Γ spread (nats) of a
    channel of a pair tile in the dots, added on its own past it; the default is the fp32-safe one, ±inf sends every
    channel one way (the tests' check of each)."""
    q, k, v, g, s0, mask, scale, raw, BK = verify_inputs(q, k, v, g, initial_state, tree_mask, scale, A_log, dt_bias,
                                                         BKC, MAX_NODES, "kda_tree_verify_triton")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = torch.empty((B, T, HV, V), dtype=v.dtype, device=v.device)
    u = torch.empty((B, T, HV, V), dtype=torch.float32, device=v.device)
    gamma = torch.empty((B, T, HV, K), dtype=torch.float32, device=v.device)
    kk, qk = torch.empty((2, B, HV, T, T), dtype=torch.float32, device=v.device)  # (one allocation)
    NB = triton.cdiv(T, 16)
    a_log, dt = (A_log.contiguous(), dt_bias.contiguous()) if raw else (s0, s0)
    with launch_ctx(INTERPRET):
        _kda_gamma_kernel[(NB, B * HV)](g, mask, gamma, a_log, dt, T, g.stride(0), g.stride(1), g.stride(2),
                                        H=H, HV=HV, K=K, BK=BK, BT=16, RAW_GATES=raw, num_warps=num_warps)
        _kda_pairs_kernel[(NB * NB, B * HV)](
            q, k, mask, gamma, kk, qk, T, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            H=H, HV=HV, K=K, BK=BK, BKC=BKC, BT=16, NB=NB, L2NORM=bool(use_qk_l2norm_in_kernel),
            SPREAD_MAX=float(pair_spread_max), num_warps=num_warps,
        )
        _kda_tree_verify_kernel[(triton.cdiv(V, BV), B * HV)](
            q, k, v, g, beta, s0, o, u, gamma, kk, qk, T, scale,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            g.stride(0), g.stride(1), g.stride(2),
            beta.stride(0), beta.stride(1), beta.stride(2),
            H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, L2NORM=bool(use_qk_l2norm_in_kernel), BT=16, LOG2_BT=4,
            RAW_GATES=raw, num_warps=num_warps, num_stages=1,
        )
    return o, u, gamma

"""Tree GDN commit: advance the committed state along the accepted path, in place (one read and one write of S).

For the accepted leaf ℓ, ``S* = exp(Γ_ℓ) S0 + Σ_{j ∈ path(ℓ)} exp(Γ_ℓ − Γ_j) k_j u_jᵀ`` from the verify's ``u`` and
``gamma``: no re-solve. ``path`` may be right-padded with -1, so a fixed-size buffer works under CUDA graphs.
Accumulation is fp32; the path product's dot is IEEE fp32 by default (``precision``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import INTERPRET, head_program, lanes, node_rows, path_leaf, rsum, state_tile
from ..utils import launch_ctx, next_pow2
from .common import check_precision, last_contig


@triton.jit
def _gdn_tree_commit_kernel(
    state, k, u, gamma, path, L, T,
    sk_b, sk_t, sk_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    LP: tl.constexpr, BK: tl.constexpr, BKF: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
    CH: tl.constexpr, PREC: tl.constexpr,
):
    i_b64, i_hv, i_h = head_program(H, HV)
    o_k, m_k = lanes(tl.program_id(2), BK, K)  # state rows i_k*BK.. (BK < BKF: the state split over K as well)
    o_kf = tl.arange(0, BKF)
    o_v, m_v = lanes(tl.program_id(0), BV, V)

    n, leaf = path_leaf(path, L, LP)
    gm_base = node_rows(gamma, i_b64, i_hv, T, HV, 1)
    G_leaf = tl.load(gm_base + leaf * HV, mask=n > 0, other=0.0)

    s_ptr = state_tile(state, i_b64, i_hv, HV, K, V) + o_k[:, None] * V + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    S = tl.load(s_ptr, mask=m_s, other=0.0).to(tl.float32)  # issued early: its latency hides under the path loop

    # Σ_j coef_j k_j u_jᵀ over the path, CH entries at a time (bounded registers for long chains; each chunk is a
    # chain of dependent loads, path → γ, k, u, so fewer, larger chunks cost less latency)
    o_c = tl.arange(0, CH)
    k_base = k + i_b64 * sk_b + i_h * sk_h
    u_base = node_rows(u, i_b64, i_hv, T, HV, V)
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
                cj = cj * tl.rsqrt(rsum(kf * kf, axis=1) + 1e-6)
            else:
                cj = cj * tl.rsqrt(rsum(kj * kj, axis=1) + 1e-6)
        uj = tl.load(u_base + pj[:, None] * (HV * V) + o_v[None, :], mask=vj[:, None] & m_v[None, :], other=0.0)
        delta += tl.dot(tl.trans(kj * cj[:, None]), uj, input_precision=PREC)  # [BK, BV]

    S = tl.exp(G_leaf) * S + delta
    tl.store(s_ptr, S.to(state.dtype.element_ty), mask=m_s)


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
    loop step (a power of two ≥ 16; capped at the padded path length; 32 measured fastest on long paths).
    ``precision``: of the path product's dot (``"ieee"``, ``"tf32x3"`` or ``"tf32"``, as for the verify's inverse).
    ``split_k``: programs per value block along K (1, 2, 4: smaller state tiles, more programs in flight; measured
    slower on long paths, so 1 by default). ``BV``: value columns per program (default 16, the fastest measured).
    """
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    if not state.is_contiguous():
        raise ValueError("state must be contiguous [B, HV, K, V]")
    k = last_contig(k)
    u = u.contiguous()
    gamma = gamma.contiguous()
    path = path.to(device=state.device)
    L = path.numel()
    BKF = max(16, next_pow2(K))
    if split_k not in (1, 2, 4) or BKF // split_k < 16:
        raise ValueError(f"split_k must be 1, 2 or 4 and leave at least 16 state rows per program, got {split_k}")
    BK = BKF // split_k
    if BV is None:  # more programs per value head stream the state faster (BENCHMARKS.md, Kernels)
        BV = 16
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    check_precision(precision)
    LP = max(16, next_pow2(L))
    with launch_ctx(INTERPRET):
        _gdn_tree_commit_kernel[(triton.cdiv(V, BV), B * HV, split_k)](
            state, k, u, gamma, path, L, T,
            k.stride(0), k.stride(1), k.stride(2),
            H=H, HV=HV, K=K, V=V, LP=LP, BK=BK, BKF=BKF, BV=BV,
            L2NORM=bool(use_qk_l2norm_in_kernel), CH=min(chunk, LP), PREC=precision, num_warps=num_warps,
            num_stages=1,
        )
    return state

"""Tree KDA commit in Triton: advance the committed state along the accepted path, in place (one read and one write
of S).

For the accepted leaf ℓ, ``S* = Diag(e^{Γ_ℓ}) S0 + Σ_{j ∈ path(ℓ)} (k_j ⊙ e^{Γ_ℓ − Γ_j}) u_jᵀ`` (docs/DESIGN.md §13)
from the verify's ``u`` and per-channel ``gamma``: no re-solve. Every exponent is ≤ 0 on the path. ``path`` may be
right-padded with -1, so a fixed-size buffer works under CUDA graphs. Accumulation and the dot are IEEE fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gdn_tree.common import last_contig
from ..triton_utils import INTERPRET, head_program, lanes, node_rows, path_leaf, rsum, state_tile
from ..utils import launch_ctx, next_pow2


@triton.jit
def _kda_tree_commit_kernel(
    state, k, u, gamma, path, L, T,
    sk_b, sk_t, sk_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    LP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, CH: tl.constexpr,
):
    i_b64, i_hv, i_h = head_program(H, HV)
    o_k, m_k = lanes(0, BK, K)
    o_v, m_v = lanes(tl.program_id(0), BV, V)

    n, leaf = path_leaf(path, L, LP)
    gm_base = node_rows(gamma, i_b64, i_hv, T, HV, K)  # Γ per channel
    # (a vector test: the interpreter mishandles bool-scalar masks)
    G_leaf = tl.load(gm_base + leaf * (HV * K) + o_k, mask=m_k & (o_k * 0 + n > 0), other=0.0)  # [BK]

    s_ptr = state_tile(state, i_b64, i_hv, HV, K, V) + o_k[:, None] * V + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    S = tl.load(s_ptr, mask=m_s, other=0.0).to(tl.float32)

    # Σ_j (k_j ⊙ e^{Γ_ℓ − Γ_j}) u_jᵀ over the path, CH entries at a time
    o_c = tl.arange(0, CH)
    k_base = k + i_b64 * sk_b + i_h * sk_h
    u_base = node_rows(u, i_b64, i_hv, T, HV, V)
    delta = tl.full([BK, BV], 0.0, tl.float32)
    for c in range(0, (n + CH - 1) // CH):
        j = c * CH + o_c
        pj = tl.load(path + j, mask=j < n, other=-1).to(tl.int32)
        vj = pj >= 0
        pj = tl.where(vj, pj, 0)
        m_jk = vj[:, None] & m_k[None, :]
        G_j = tl.load(gm_base + pj[:, None] * (HV * K) + o_k[None, :], mask=m_jk, other=0.0)
        cj = tl.exp(tl.where(m_jk, G_leaf[None, :] - G_j, float("-inf")))  # [CH, BK], 0 off the path
        kj = tl.load(k_base + pj[:, None] * sk_t + o_k[None, :], mask=m_jk, other=0.0).to(tl.float32)
        if L2NORM:
            kj = kj * tl.rsqrt(rsum(kj * kj, axis=1) + 1e-6)[:, None]
        uj = tl.load(u_base + pj[:, None] * (HV * V) + o_v[None, :], mask=vj[:, None] & m_v[None, :], other=0.0)
        delta += tl.dot(tl.trans(kj * cj), uj, input_precision="ieee")  # [BK, BV]

    S = tl.exp(G_leaf)[:, None] * S + delta
    tl.store(s_ptr, S.to(state.dtype.element_ty), mask=m_s)


def kda_tree_commit_triton(
    state: torch.Tensor,
    k: torch.Tensor,
    u: torch.Tensor,
    gamma: torch.Tensor,
    path: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    BV: int = 16,
    chunk: int = 16,
    num_warps: int = 4,
) -> torch.Tensor:
    """Triton version of :func:`~weaver_kernels.kda_tree.naive.kda_tree_commit_ref`: advances ``state`` in place.

    ``path`` (node indices root..leaf, on the device) may be right-padded with -1. ``chunk``: path entries per loop
    step (a power of two ≥ 16). ``BV``: value columns per program."""
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    if not state.is_contiguous():
        raise ValueError("state must be contiguous [B, HV, K, V]")
    if tuple(gamma.shape) != (B, T, HV, K):
        raise ValueError(f"gamma must be [B, T, HV, K] = {(B, T, HV, K)}, got {tuple(gamma.shape)}")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    k = last_contig(k)
    u = u.contiguous()
    gamma = gamma.contiguous()
    path = path.to(device=state.device)
    L = path.numel()
    LP = max(16, next_pow2(L))
    with launch_ctx(INTERPRET):
        _kda_tree_commit_kernel[(triton.cdiv(V, BV), B * HV)](
            state, k, u, gamma, path, L, T,
            k.stride(0), k.stride(1), k.stride(2),
            H=H, HV=HV, K=K, V=V, LP=LP, BK=max(16, next_pow2(K)), BV=BV,
            L2NORM=bool(use_qk_l2norm_in_kernel), CH=min(chunk, LP), num_warps=num_warps, num_stages=1,
        )
    return state

"""The mainline approach to tree verification through GDN layers (what SGLang/vLLM do today), as a benchmark baseline.

A recurrent kernel walks the flattened tree in topological order, one node after another: it starts each node
from its parent's state — kept in registers when the parent is the previous node, otherwise reloaded from the
intermediate-state buffer (the committed state for the root) — applies the delta rule, emits o, and writes the node's
full state ``[K, V]`` to the intermediate buffer ``[B, T, HV, K, V]`` (fp32, the state dtype). After acceptance the
accepted leaf's state is copied into the committed state (:func:`recurrent_tree_accept`).

This writes T full states per layer (T·HV·K·V·4 bytes: 201 MB at T=64 for Qwen3.6-27B's GDN shape), which is
what the rollback-free kernels in :mod:`.chunk` avoid. It is correct (tests compare it with the references) and
tuned only by its block size: it is a baseline, not a proposal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import INTERPRET, head_inputs, head_program, lanes, node_rows, rsum, state_tile
from ..utils import launch_ctx, next_pow2


@triton.jit
def _recurrent_tree_kernel(
    q, k, v, g, beta, s0, parents, o, inter,
    T, scale,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, sg_h, sb_b, sb_t, sb_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr,
):
    i_b64, i_hv, i_h = head_program(H, HV)
    o_k, m_k = lanes(0, BK, K)
    o_v, m_v = lanes(tl.program_id(0), BV, V)
    m_h = m_k[:, None] & m_v[None, :]
    tile = o_k[:, None] * V + o_v[None, :]
    q_base, k_base, v_base, g_base, b_base = head_inputs(q, k, v, g, beta, i_b64, i_hv, i_h, sq_b, sq_h, sk_b, sk_h,
                                                         sv_b, sv_h, sg_b, sg_h, sb_b, sb_h)

    s0_ptr = state_tile(s0, i_b64, i_hv, HV, K, V) + tile
    inter_base = node_rows(inter, i_b64, i_hv, T, HV, K * V) + tile  # + t * HV * K * V
    st = i_b64 * 0 + HV * K * V  # int64 stride between nodes' states
    h = tl.load(s0_ptr, mask=m_h, other=0.0).to(tl.float32)
    for t in range(0, T):
        par = tl.load(parents + t).to(tl.int32)
        par_t = par + tl.full([BK, BV], 0, tl.int32)  # block-shaped predicates (scalar & block masks upset
        is_root = par_t < 0  # the interpreter)
        reload = (par_t >= 0) & (par_t != t - 1)
        h_root = tl.load(s0_ptr, mask=m_h & is_root, other=0.0).to(tl.float32)
        h_par = tl.load(inter_base + tl.where(par >= 0, par, 0) * st, mask=m_h & reload, other=0.0)
        h = tl.where(is_root, h_root, tl.where(reload, h_par, h))

        kt = tl.load(k_base + t * sk_t + o_k, mask=m_k, other=0.0).to(tl.float32)
        qt = tl.load(q_base + t * sq_t + o_k, mask=m_k, other=0.0).to(tl.float32)
        if L2NORM:
            kt = kt * tl.rsqrt(rsum(kt * kt, axis=0) + 1e-6)
            qt = qt * tl.rsqrt(rsum(qt * qt, axis=0) + 1e-6)
        vt = tl.load(v_base + t * sv_t + o_v, mask=m_v, other=0.0).to(tl.float32)
        gt = tl.load(g_base + t * sg_t).to(tl.float32)
        bt = tl.load(b_base + t * sb_t).to(tl.float32)

        h = h * tl.exp(gt)
        delta = bt * (vt - rsum(h * kt[:, None], axis=0))
        h = h + kt[:, None] * delta[None, :]
        ot = rsum(h * qt[:, None], axis=0) * scale
        tl.store(node_rows(o, i_b64, i_hv, T, HV, V) + t * HV * V + o_v, ot.to(o.dtype.element_ty), mask=m_v)
        tl.store(inter_base + t * st, h, mask=m_h)
        tl.debug_barrier()  # a later node may reload this state


def recurrent_tree_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    parents: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    intermediate: torch.Tensor | None = None,
    BV: int = 32,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mainline tree verify: returns ``o [B, T, HV, V]`` and every node's state ``[B, T, HV, K, V]`` (fp32)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else float(scale)
    o = torch.empty((B, T, HV, V), dtype=v.dtype, device=v.device)
    if intermediate is None:
        intermediate = torch.empty((B, T, HV, K, V), dtype=torch.float32, device=v.device)
    s0 = initial_state.contiguous()
    BV = min(BV, max(16, next_pow2(V)))
    with launch_ctx(INTERPRET):
        _recurrent_tree_kernel[(triton.cdiv(V, BV), B * HV)](
            q, k, v, g, beta, s0, parents.to(v.device), o, intermediate, T, scale,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1), g.stride(2),
            beta.stride(0), beta.stride(1), beta.stride(2),
            H=H, HV=HV, K=K, V=V, BK=max(16, next_pow2(K)), BV=BV, L2NORM=bool(use_qk_l2norm_in_kernel),
            num_warps=num_warps, num_stages=1,
        )
    return o, intermediate


def recurrent_tree_accept(state: torch.Tensor, intermediate: torch.Tensor, leaf: torch.Tensor | int) -> torch.Tensor:
    """Copy the accepted leaf's intermediate state into the committed state (one read + one write of S)."""
    if isinstance(leaf, torch.Tensor):
        state.copy_(intermediate.index_select(1, leaf.reshape(1)).squeeze(1))
    else:
        state.copy_(intermediate[:, leaf])
    return state

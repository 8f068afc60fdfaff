"""Triton kernel for one Weaver layer's attention in an expansion round (reference: ``naive.node_attention_ref``).

The unfused form is a chain of small kernels per round and layer: RoPE on q and k, two slot writes, two
concatenations of prompt and node K/V, the mask's concatenation, masked SDPA and the layout copies around it (≈ 10
launches). Here it is one launch.

Grid: one program per head. It rotates the round's ``M ≤ 16`` q and k rows, writes k and v into the node slots
``lo .. lo + M - 1``, then (after a barrier, so the program reads back its own writes) runs an online softmax over
blocks of the virtual key sequence ``[prompt | node slots]``: prompt keys always visible, node slot ``j`` where the
node's mask row allows it. Heads are processed as two halves of ``D / 2`` (RoPE pairs element ``i`` with ``i + D/2``),
so head sizes that are not powers of two (SmolLM2's Weaver: 144) only pad each half.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..triton_utils import INTERPRET, add, maximum
from ..utils import NODE_ATTENTION_MAX_ROWS, launch_ctx, next_pow2


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    if F32:  # IEEE fp32 (exact upcast of 16-bit operands; no tf32 rounding)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _node_attention_kernel(qkv, positions, prompt_k, prompt_v, node_k, node_v, mask, out, lo, M, P, N, log2_base,
                           scale, s_qkv, s_mask, s_out,
                           H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BM: tl.constexpr,
                           BH: tl.constexpr, BL: tl.constexpr, DOT_F32: tl.constexpr):
    h = tl.program_id(0)
    o_m = tl.arange(0, BM)
    m_m = o_m < M
    o_d = tl.arange(0, BH)
    m_d = o_d < HALF
    m_md = m_m[:, None] & m_d[None, :]
    dtype = node_k.dtype.element_ty
    # RoPE angles (fp32, as the module): position · base^(−2i/D)
    pos = tl.load(positions + o_m, mask=m_m, other=0).to(tl.float32)
    inv_freq = tl.exp2(-(2.0 * o_d.to(tl.float32) / D) * log2_base)
    angle = pos[:, None] * inv_freq[None, :]
    cos, sin = tl.cos(angle), tl.sin(angle)
    row = qkv + o_m[:, None] * s_qkv + o_d[None, :]
    q1 = tl.load(row + h * D, mask=m_md, other=0.0).to(tl.float32)
    q2 = tl.load(row + h * D + HALF, mask=m_md, other=0.0).to(tl.float32)
    k1 = tl.load(row + (H + h) * D, mask=m_md, other=0.0).to(tl.float32)
    k2 = tl.load(row + (H + h) * D + HALF, mask=m_md, other=0.0).to(tl.float32)
    v1 = tl.load(row + (2 * H + h) * D, mask=m_md, other=0.0)
    v2 = tl.load(row + (2 * H + h) * D + HALF, mask=m_md, other=0.0)
    q1, q2 = (q1 * cos - q2 * sin).to(dtype), (q2 * cos + q1 * sin).to(dtype)
    k1, k2 = (k1 * cos - k2 * sin).to(dtype), (k2 * cos + k1 * sin).to(dtype)
    slot = node_k + h * N * D + (lo + o_m[:, None]) * D + o_d[None, :]
    tl.store(slot, k1, mask=m_md)
    tl.store(slot + HALF, k2, mask=m_md)
    slot_v = node_v + h * N * D + (lo + o_m[:, None]) * D + o_d[None, :]
    tl.store(slot_v, v1.to(dtype), mask=m_md)
    tl.store(slot_v + HALF, v2.to(dtype), mask=m_md)
    tl.debug_barrier()  # the slots just written are read back below, by other threads of this program

    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.full([BM], 0.0, tl.float32)
    acc1 = tl.full([BM, BH], 0.0, tl.float32)
    acc2 = tl.full([BM, BH], 0.0, tl.float32)
    for j0 in range(0, P + N, BL):
        o_j = j0 + tl.arange(0, BL)
        in_p = o_j < P
        in_n = (o_j >= P) & (o_j < P + N)
        jn = o_j - P
        m_pk = in_p[:, None] & m_d[None, :]
        m_nk = in_n[:, None] & m_d[None, :]
        p_row = h * P * D + o_j[:, None] * D + o_d[None, :]
        n_row = h * N * D + jn[:, None] * D + o_d[None, :]
        kb1 = tl.load(prompt_k + p_row, mask=m_pk, other=0.0).to(dtype) + tl.load(node_k + n_row, mask=m_nk, other=0.0)
        kb2 = (tl.load(prompt_k + p_row + HALF, mask=m_pk, other=0.0).to(dtype)
               + tl.load(node_k + n_row + HALF, mask=m_nk, other=0.0))
        s = _dot(q1, tl.trans(kb1), DOT_F32) + _dot(q2, tl.trans(kb2), DOT_F32)
        seen = tl.load(mask + o_m[:, None] * s_mask + jn[None, :], mask=m_m[:, None] & in_n[None, :], other=0)
        visible = in_p[None, :] | (seen != 0)
        s = tl.where(visible, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, maximum))  # the prompt's first block is always visible: finite
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, add)
        vb1 = tl.load(prompt_v + p_row, mask=m_pk, other=0.0).to(dtype) + tl.load(node_v + n_row, mask=m_nk, other=0.0)
        vb2 = (tl.load(prompt_v + p_row + HALF, mask=m_pk, other=0.0).to(dtype)
               + tl.load(node_v + n_row + HALF, mask=m_nk, other=0.0))
        acc1 = acc1 * alpha[:, None] + _dot(p.to(dtype), vb1, DOT_F32)  # p rounded to the value dtype, as SDPA
        acc2 = acc2 * alpha[:, None] + _dot(p.to(dtype), vb2, DOT_F32)
        m_i = m_new
    o_row = out + o_m[:, None] * s_out + h * D + o_d[None, :]
    tl.store(o_row, (acc1 / l_i[:, None]).to(out.dtype.element_ty), mask=m_md)
    tl.store(o_row + HALF, (acc2 / l_i[:, None]).to(out.dtype.element_ty), mask=m_md)


def node_attention_triton(qkv: torch.Tensor, positions: torch.Tensor, prompt_k: torch.Tensor, prompt_v: torch.Tensor,
                          node_k: torch.Tensor, node_v: torch.Tensor, mask: torch.Tensor, lo: int, rope_base: float,
                          scale: float, *, BL: int = 32, num_warps: int = 4) -> torch.Tensor:
    """Triton version of :func:`.naive.node_attention_ref` (same arguments; ``node_k`` / ``node_v`` written in
    place). Needs contiguous ``[H, ·, D]`` prompt and node K/V, an even ``D`` and ``M ≤ 16``."""
    M = qkv.shape[0]
    H, N, D = node_k.shape
    P = prompt_k.shape[1]
    if M > NODE_ATTENTION_MAX_ROWS or D % 2 or qkv.shape[1] != 3 * H * D or qkv.stride(1) != 1:
        raise ValueError(f"node_attention: qkv [M ≤ {NODE_ATTENTION_MAX_ROWS}, 3·H·D] (last dim contiguous) and an "
                         f"even head size; got {tuple(qkv.shape)} for {H} heads of {D}")
    for name, t, rows in (("prompt_k", prompt_k, P), ("prompt_v", prompt_v, P), ("node_k", node_k, N),
                          ("node_v", node_v, N)):
        if t.shape != (H, rows, D) or not t.is_contiguous():
            raise ValueError(f"node_attention: {name} must be a contiguous [{H}, {rows}, {D}] tensor, got "
                             f"{tuple(t.shape)}")
    if qkv.dtype != node_k.dtype or node_v.dtype != node_k.dtype:
        raise ValueError(f"node_attention: qkv and the node slots must share a dtype, got {qkv.dtype}, "
                         f"{node_k.dtype}, {node_v.dtype}")
    if mask.shape != (M, N) or mask.stride(1) != 1 or lo + M > N:
        raise ValueError(f"node_attention: mask [{M}, {N}] with rows {lo}..{lo + M - 1} among {N} slots")
    out = torch.empty(M, H * D, device=qkv.device, dtype=qkv.dtype)
    mask_u8 = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    # fp32 slots get IEEE fp32 dots; so do 16-bit ones under the interpreter, whose tl.dot multiplies 16-bit
    # operands as raw bits
    dot_f32 = INTERPRET or node_k.dtype == torch.float32
    with launch_ctx(INTERPRET):
        _node_attention_kernel[(H,)](
            qkv, positions, prompt_k, prompt_v, node_k, node_v, mask_u8, out, int(lo), M, P, N,
            float(math.log2(rope_base)), float(scale), qkv.stride(0), mask_u8.stride(0), out.stride(0),
            H=H, D=D, HALF=D // 2, BM=16, BH=max(16, next_pow2(D // 2)), BL=BL,
            DOT_F32=dot_f32, num_warps=num_warps,
            # fp32 tiles in a 3-stage pipeline overflow shared memory at SmolLM2's padded heads (313 KB of 227 on
            # the H200, budget 128): one stage there (the 16-bit path keeps Triton's default)
            num_stages=1 if node_k.dtype == torch.float32 else 3,
        )
    return out

"""Triton kernels for the depthwise causal conv1d over a tree (docs/DESIGN.md §5) and its commit.

Verify: node i convolves ``[x_anc(W-1)(i), …, x_parent(i), x_i]`` — its nearest ancestors, continued above the root
by the committed window (oldest first). Each program walks W-1 parent hops for a block of nodes (indices only, all
in registers), gathers the W taps for a block of channels, accumulates in fp32, adds the bias, applies SiLU and
writes ``[B, T, C]``. Reads the window, writes nothing else. Memory-bound: x, out, weight, window once each.

Commit: the new window is the last W-1 entries of ``cat(window, x[path])`` along time, written in place.
``path`` may be right-padded with -1 (fixed-size buffers under CUDA graphs).

The window may be any strided view ``[B, C, W-1]`` (e.g. ``conv_state[..., 1:]`` of a width-W cache).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import INTERPRET, rsum
from ..utils import launch_ctx, next_pow2


@triton.jit
def _conv_tree_kernel(
    x, window, weight, bias, parents, out,
    T, C,
    sx_b, sx_t, sw_b, sw_c, sw_w, so_b, so_t,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_n = tl.program_id(1)
    i_b = tl.program_id(2).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < T
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C

    acc = tl.full([BN, BC], 0.0, tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias + o_c, mask=m_c, other=0.0).to(tl.float32)[None, :]
    # `cur` indexes cat(window, x) along time: window entries 0..W-2, node j is W-1+j
    cur = o_n + (W - 1)
    for s in tl.static_range(W):
        is_node = cur >= W - 1
        node = tl.where(is_node, cur - (W - 1), 0)
        xv = tl.load(x + i_b * sx_b + node[:, None] * sx_t + o_c[None, :],
                     mask=(m_n & is_node)[:, None] & m_c[None, :], other=0.0)
        wv = tl.load(window + i_b * sw_b + o_c[None, :] * sw_c + tl.where(is_node, 0, cur)[:, None] * sw_w,
                     mask=(m_n & ~is_node)[:, None] & m_c[None, :], other=0.0)
        tap = tl.where(is_node[:, None], xv.to(tl.float32), wv.to(tl.float32))
        wt = tl.load(weight + o_c * W + (W - 1 - s), mask=m_c, other=0.0).to(tl.float32)
        acc += tap * wt[None, :]
        if s < W - 1:
            par = tl.load(parents + node, mask=m_n & is_node, other=-1).to(tl.int32)
            cur = tl.where(is_node, tl.where(par >= 0, par + (W - 1), W - 2), cur - 1)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out + i_b * so_b + o_n[:, None] * so_t + o_c[None, :], acc.to(out.dtype.element_ty),
             mask=m_n[:, None] & m_c[None, :])


@triton.jit
def _conv_tree_commit_kernel(
    window, x, path, L, C,
    sx_b, sx_t, sw_b, sw_c, sw_w,
    W1: tl.constexpr, BW: tl.constexpr, LP: tl.constexpr, BC: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    o_l = tl.arange(0, LP)
    p = tl.load(path + o_l, mask=o_l < L, other=-1).to(tl.int32)
    n = rsum((p >= 0).to(tl.int32), axis=0)

    o_s = tl.arange(0, BW)  # new window slot s (oldest first) takes position n + s of cat(window, x[path])
    m_s = o_s < W1
    pos = n + o_s
    from_win = pos < W1
    node = rsum(tl.where(o_l[None, :] == (pos - W1)[:, None], p[None, :], 0), axis=1)
    xv = tl.load(x + i_b * sx_b + node[:, None] * sx_t + o_c[None, :],
                 mask=(m_s & ~from_win)[:, None] & m_c[None, :], other=0.0)
    w_base = window + i_b * sw_b + o_c[None, :] * sw_c
    wv = tl.load(w_base + tl.where(from_win, pos, 0)[:, None] * sw_w, mask=(m_s & from_win)[:, None] & m_c[None, :],
                 other=0.0)
    new = tl.where(from_win[:, None], wv.to(tl.float32), xv.to(tl.float32))
    tl.debug_barrier()  # every read of the old window precedes every write (in place, across threads)
    tl.store(w_base + o_s[:, None] * sw_w, new.to(window.dtype.element_ty), mask=m_s[:, None] & m_c[None, :])


@triton.jit
def _conv_decode_kernel(
    x, window, weight, bias, out, C,
    sx_b, sw_b, sw_c, sw_w, so_b,
    W: tl.constexpr, BW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BC: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    o_s = tl.arange(0, BW)  # time slots: window entries 0..W-2 (oldest first), the token at W-1
    m_w = (o_s < W - 1)[:, None] & m_c[None, :]
    w_base = window + i_b * sw_b + o_c[None, :] * sw_c
    win = tl.load(w_base + tl.where(o_s < W - 1, o_s, 0)[:, None] * sw_w, mask=m_w, other=0.0)
    xv = tl.load(x + i_b * sx_b + o_c, mask=m_c, other=0.0)
    seq = tl.where((o_s == W - 1)[:, None], xv[None, :].to(tl.float32), win.to(tl.float32))
    wt = tl.load(weight + o_c[None, :] * W + o_s[:, None], mask=(o_s < W)[:, None] & m_c[None, :], other=0.0)
    acc = rsum(seq * wt.to(tl.float32), 0)
    if HAS_BIAS:
        acc += tl.load(bias + o_c, mask=m_c, other=0.0).to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out + i_b * so_b + o_c, acc.to(out.dtype.element_ty), mask=m_c)
    # new window slot s takes time slot s + 1 (an own program's channels only: no other program reads them)
    shifted = tl.load(w_base + tl.where(o_s + 1 < W - 1, o_s + 1, 0)[:, None] * sw_w,
                      mask=((o_s + 1 < W - 1)[:, None] & m_c[None, :]), other=0.0)
    new = tl.where((o_s + 1 == W - 1)[:, None], xv[None, :].to(window.dtype.element_ty), shifted)
    tl.debug_barrier()  # every read of the old window precedes every write (in place, across threads)
    tl.store(w_base + o_s[:, None] * sw_w, new, mask=m_w)


def conv_decode_triton(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       activation: str | None = "silu", *, BC: int = 256, num_warps: int = 4) -> torch.Tensor:
    """Triton version of :func:`~weaver_kernels.conv_tree.naive.conv_decode_ref`: one token ``x [B, 1, C]``,
    output and the window slid in place, in one launch (conv + commit of a one-node tree)."""
    if activation not in (None, "silu"):
        raise ValueError(f"unsupported activation {activation!r}")
    B, T, C = x.shape
    W = weight.shape[-1]
    if T != 1:
        raise ValueError(f"conv_decode takes one token, got {T}")
    if tuple(window.shape) != (B, C, W - 1):
        raise ValueError(f"window must be [{B}, {C}, {W - 1}], got {tuple(window.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.reshape(C, W).contiguous()
    out = torch.empty((B, 1, C), dtype=x.dtype, device=x.device)
    BC = min(BC, max(16, next_pow2(C)))
    with launch_ctx(INTERPRET):
        _conv_decode_kernel[(triton.cdiv(C, BC), B)](
            x, window, weight, bias if bias is not None else weight, out, C,
            x.stride(0), window.stride(0), window.stride(1), window.stride(2), out.stride(0),
            W=W, BW=max(2, next_pow2(W)), HAS_BIAS=bias is not None, SILU=activation == "silu", BC=BC,
            num_warps=num_warps,
        )
    return out


def conv_tree_triton(
    x: torch.Tensor,
    window: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    parents: torch.Tensor,
    activation: str | None = "silu",
    *,
    BN: int = 16,
    BC: int = 128,
    num_warps: int = 4,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of :func:`~weaver_kernels.conv_tree.naive.conv_tree_ref` (fp32 accumulation).

    ``out`` may be a preallocated ``[B, T, C]`` tensor (last dim contiguous).
    """
    if activation not in (None, "silu"):
        raise ValueError(f"unsupported activation {activation!r}")
    B, T, C = x.shape
    W = weight.shape[-1]
    if tuple(window.shape) != (B, C, W - 1):
        raise ValueError(f"window must be [{B}, {C}, {W - 1}], got {tuple(window.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.reshape(C, W).contiguous()
    parents = parents.to(device=x.device)
    if out is None:
        out = torch.empty((B, T, C), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (B, T, C) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{B}, {T}, {C}] with a contiguous last dim")
    BC = min(BC, max(16, next_pow2(C)))
    BN = min(BN, max(1, next_pow2(T)))
    grid = (triton.cdiv(C, BC), triton.cdiv(T, BN), B)
    with launch_ctx(INTERPRET):
        _conv_tree_kernel[grid](
            x, window, weight, bias if bias is not None else weight, parents, out, T, C,
            x.stride(0), x.stride(1), window.stride(0), window.stride(1), window.stride(2), out.stride(0), out.stride(1),
            W=W, HAS_BIAS=bias is not None, SILU=activation == "silu", BN=BN, BC=BC, num_warps=num_warps,
        )
    return out


def conv_tree_commit_triton(
    window: torch.Tensor, x: torch.Tensor, path: torch.Tensor, *, BC: int = 512, num_warps: int = 4
) -> torch.Tensor:
    """Triton version of :func:`~weaver_kernels.conv_tree.naive.conv_tree_commit_ref` (in place)."""
    B, C, W1 = window.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    path = path.to(device=window.device)
    L = path.numel()
    BC = min(BC, max(16, next_pow2(C)))
    with launch_ctx(INTERPRET):
        _conv_tree_commit_kernel[(triton.cdiv(C, BC), B)](
            window, x, path, L, C,
            x.stride(0), x.stride(1), window.stride(0), window.stride(1), window.stride(2),
            W1=W1, BW=max(2, next_pow2(W1)), LP=max(2, next_pow2(L)), BC=BC, num_warps=num_warps,
        )
    return window

"""Triton helpers shared by the kernel modules: combine functions for ``tl.reduce``, the interpreter flag, and the
per-head prologue of the delta-rule kernels (program → head, lanes, base pointers, the accepted path's leaf).

Kernels call Triton builtins and these helpers, never Triton's own ``@jit`` library functions (``tl.sum``, ``tl.max``,
``tl.cdiv``, ``tl.sigmoid``): those keep the mode of the process's first ``import triton``, so the interpreted copies
that :func:`~weaver_kernels.utils.load_interpreted` makes (this module re-executed with the kernels) could not call
them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .utils import is_interpret

# this copy's mode: True in the copies load_interpreted makes (they collapse autotuners and upcast 16-bit dots)
INTERPRET = is_interpret()


@triton.jit
def add(a, b):
    return a + b


@triton.jit
def maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def minimum(a, b):
    return tl.minimum(a, b)


@triton.jit
def rsum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, add)


@triton.jit
def tree_depth(M):
    """The depth of a tree from its ancestor-or-self mask ``M`` (bool, every node's row): the most ancestors of a
    node, less itself (the Neumann forms' Horner count)."""
    return tl.reduce(rsum(M.to(tl.int32), axis=1), 0, maximum) - 1


@triton.jit
def head_program(H: tl.constexpr, HV: tl.constexpr):
    """``(i_b, i_hv, i_h)`` of a program whose grid axis 1 runs over batch × HV value heads, value heads grouped
    over the H query/key heads: the batch index as int64 (its offsets span every head), the value head, the key
    head. The prologue every per-head delta-rule kernel shares."""
    i_bh = tl.program_id(1)
    i_hv = i_bh % HV
    return (i_bh // HV).to(tl.int64), i_hv, i_hv // (HV // H)


@triton.jit
def lanes(i, B: tl.constexpr, N):
    """Offsets ``i·B .. i·B + B − 1`` of block ``i`` and their mask (below ``N``)."""
    o = i * B + tl.arange(0, B)
    return o, o < N


@triton.jit
def node_rows(x, i_b, i_hv, T, HV: tl.constexpr, W: tl.constexpr):
    """Base of value head ``i_hv``'s row 0 in a contiguous ``[B, T, HV, W]`` tensor (the kernels' own outputs and
    scratch: ``o``, ``u``, ``gamma``); node ``t``'s row is ``t · HV · W`` further."""
    return x + i_b * T * HV * W + i_hv * W


@triton.jit
def state_tile(s, i_b, i_hv, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Base of value head ``i_hv``'s ``[K, V]`` state in a contiguous ``[B, HV, K, V]`` tensor."""
    return s + (i_b * HV + i_hv) * K * V


@triton.jit
def head_inputs(q, k, v, g, beta, i_b, i_hv, i_h, sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sg_b, sg_h, sb_b, sb_h):
    """Bases of one program's head in the delta-rule inputs (strided ``[B, T, heads, ·]``): q and k at key head
    ``i_h``, v, g and β at value head ``i_hv``."""
    return (q + i_b * sq_b + i_h * sq_h, k + i_b * sk_b + i_h * sk_h, v + i_b * sv_b + i_hv * sv_h,
            g + i_b * sg_b + i_hv * sg_h, beta + i_b * sb_b + i_hv * sb_h)


@triton.jit
def path_leaf(path, L, LP: tl.constexpr):
    """``(n, leaf)`` of an accepted path (node indices, −1 padded, ``L`` entries): its length and its last node."""
    o_l = tl.arange(0, LP)
    p = tl.load(path + o_l, mask=o_l < L, other=-1).to(tl.int32)
    n = rsum((p >= 0).to(tl.int32), axis=0)
    return n, rsum(tl.where(o_l == n - 1, p, 0), axis=0)

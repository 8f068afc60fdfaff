"""Triton helpers shared by the kernel modules: combine functions for ``tl.reduce`` and the interpreter flag.

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
def fsum(x, axis: tl.constexpr):
    """``rsum`` with Triton's own sum combine: compiled, the same reduction; the interpreter recognises that combine
    and sums with numpy instead of calling it element by element (the KDA pair scores' [16, 16, BKC] tiles)."""
    return tl.reduce(x, axis, tl.standard._sum_combine)

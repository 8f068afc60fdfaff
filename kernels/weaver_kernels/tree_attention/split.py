"""Triton split-KV (flash-decoding) tree attention over a static KV cache.

A captured verify step attends over a fixed ``bound`` of cache rows (the whole cache bucket) while only the first
``length + N`` are in use. A fused attention kernel with one program per (query block, head) reads all of them
serially on a few dozen SMs, so its cost follows the bound, not the rows in use (against masked SDPA:
``scripts/bench_tree_attention.py``, BENCHMARKS.md, Kernels). Here:

1. ``_split_kernel``, grid (query blocks, kv heads, splits): each program takes ``SPLIT`` cache rows of one kv head
   and the queries of all its ``G = H / HKV`` query heads (rows ``(head, node)`` flattened: the kv rows are read
   once per block of 64 query rows, not once per query head), runs an online softmax over them and writes its
   partial output and log-sum-exp. Splits wholly past ``length + N`` (read from the device) read no rows and
   store an empty result (log-sum-exp −inf, which the combine skips), so the cost follows the used length, not the
   bound.
2. ``_combine_kernel``, one program per (head, node): weights the partial outputs by their log-sum-exps and writes
   ``[N, H * D]`` in the query dtype (the o_proj input).

The visibility rule is the reference's (``naive.tree_attention_mask``): committed rows, plus the tree rows of the
node's ancestors-or-self; with a sliding ``window``, only rows whose position is within ``window`` of the query's
(tree rows at ``length + depth``, or at ``length + i`` for a DFlash block without ``depths``), and splits wholly
before every query's window are skipped; attention sinks (one logit per head, no value) join the combine's
denominator. Probabilities are cast to the value dtype before the second dot (as flash
attention does); accumulation is fp32; fp32 inputs use IEEE fp32 dots.

Plans (``split_plan``) depend on shapes only, so a captured step keeps one; the bound is any number of rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import INTERPRET, add, maximum
from ..utils import launch_ctx, next_pow2

_TARGET_PROGRAMS = 264  # two waves' worth of programs on a 132-SM H200, counted over the whole bound


@triton.jit
def _split_kernel(q, k, v, tree_mask, length_ptr, depths, o_part, lse_part, N, bound, G, scale, window,
                  sq_h, sq_n, sk_h, sk_t, sv_h, sv_t, sm_n, so_s, so_h, so_n, sl_s, sl_h,
                  D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr,
                  DOT_F32: tl.constexpr, HAS_DEPTHS: tl.constexpr):
    pid_m, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(length_ptr).to(tl.int32)
    rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < G * N
    head = kvh * G + rows // N
    node = rows % N
    dcols = tl.arange(0, BD)
    d_ok = dcols < D
    start = split * SPLIT
    stop = tl.minimum(tl.minimum(start + SPLIT, length + N), bound)
    if window > 0:  # rows at or before length − window are outside every query's window (depths are >= 0)
        start = tl.maximum(start, length + 1 - window)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.full([BM], 0.0, tl.float32)
    acc = tl.full([BM, BD], 0.0, tl.float32)
    if start < stop:
        qv = tl.load(q + head[:, None] * sq_h + node[:, None] * sq_n + dcols[None, :],
                     mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        for kb in range(start, stop, BN):
            cols = kb + tl.arange(0, BN)
            c_ok = cols < stop
            kv = tl.load(k + kvh.to(tl.int64) * sk_h + cols[:, None] * sk_t + dcols[None, :], mask=c_ok[:, None] & d_ok[None, :],
                         other=0.0)
            vv = tl.load(v + kvh.to(tl.int64) * sv_h + cols[:, None] * sv_t + dcols[None, :], mask=c_ok[:, None] & d_ok[None, :],
                         other=0.0)
            if DOT_F32:
                s = tl.dot(qv.to(tl.float32), tl.trans(kv.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(qv, tl.trans(kv))
            rel = cols - length
            in_tree = (rel >= 0) & c_ok
            tm = tl.load(tree_mask + node[:, None] * sm_n + rel[None, :], mask=row_ok[:, None] & in_tree[None, :],
                         other=0)
            visible = (((cols < length) & c_ok)[None, :] | (tm != 0)) & row_ok[:, None]
            if window > 0:  # positions minus length: committed rows below 0, tree rows at their depth (or index)
                if HAS_DEPTHS:
                    q_pos = tl.load(depths + node, mask=row_ok, other=0).to(tl.int32)
                    k_pos = tl.where(rel < 0, rel, tl.load(depths + rel, mask=in_tree, other=0).to(tl.int32))
                else:
                    q_pos, k_pos = node, rel
                visible = visible & (k_pos[None, :] > (q_pos - window)[:, None])
            s = tl.where(visible, s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(s, 1, maximum))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, add)
            if DOT_F32:  # (p rounded to the value dtype all the same)
                pv = tl.dot(p.to(vv.dtype).to(tl.float32), vv.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(vv.dtype), vv)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
    seen = l_i > 0
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(o_part + split * so_s + head[:, None] * so_h + node[:, None] * so_n + dcols[None, :], out,
             mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_part + split * sl_s + head * sl_h + node, lse, mask=row_ok)


@triton.jit
def _combine_kernel(o_part, lse_part, out, sinks, N, S, so_s, so_h, so_n, sl_s, sl_h, sout_n,
                    D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, HAS_SINKS: tl.constexpr):
    pid = tl.program_id(0)
    head, node = pid // N, pid % N
    s = tl.arange(0, BS)
    lse = tl.load(lse_part + s * sl_s + head * sl_h + node, mask=s < S, other=float("-inf"))
    m = tl.reduce(lse, 0, maximum)  # finite: every node sees itself
    w = tl.exp(lse - m)
    dcols = tl.arange(0, BD)
    live = lse > float("-inf")
    part = tl.load(o_part + s[:, None] * so_s + head * so_h + node * so_n + dcols[None, :],
                   mask=live[:, None] & (dcols < D)[None, :], other=0.0)
    den = tl.reduce(w, 0, add)
    if HAS_SINKS:
        den = den + tl.exp(tl.load(sinks + head).to(tl.float32) - m)
    res = tl.reduce(part * w[:, None], 0, add) / den
    tl.store(out + node * sout_n + head * D + dcols, res.to(out.dtype.element_ty), mask=dcols < D)


def split_plan(H: int, HKV: int, N: int, bound: int, D: int = 128, fp32: bool = False) -> tuple[int, int, int]:
    """(BM, BN, SPLIT) for a shape: query blocks of up to 64 (query head, node) rows (32 for fp32 with head_dim ≥
    256: 64 needs ≈ 140 KB of shared memory, over the ≈ 99 KB of sm86/sm89 GPUs); cache rows per program so that
    the programs over the whole bound fill about two waves of the GPU."""
    rows = (H // HKV) * N
    BM = min(32 if fp32 and D >= 256 else 64, max(16, next_pow2(rows)))
    BN = 32
    blocks = HKV * triton.cdiv(rows, BM)
    split = max(BN, next_pow2(triton.cdiv(bound * blocks, _TARGET_PROGRAMS)))
    return BM, BN, split


def tree_attention_triton(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tree_mask: torch.Tensor,
                          length: torch.Tensor, bound: int, scale: float, plan: tuple[int, int, int] | None = None,
                          out: torch.Tensor | None = None, window: int = 0,
                          depths: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as :func:`..naive.tree_attention_ref`: ``[1, N, H * D]`` in q's dtype (written into ``out``
    when given). ``plan``: ``(BM, BN, SPLIT)`` instead of :func:`split_plan`'s (tests force many splits)."""
    _, H, N, D = q.shape
    o_part, lse_part = split_partials(q, keys, values, tree_mask, length, bound, scale, plan, window, depths)
    S, BD = o_part.shape[0], max(16, next_pow2(D))
    out = torch.empty(1, N, H * D, device=q.device, dtype=q.dtype) if out is None else out
    with launch_ctx(INTERPRET):
        _combine_kernel[(H * N,)](
            o_part, lse_part, out, lse_part if sinks is None else sinks.contiguous(), N, S, o_part.stride(0),
            o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1), out.stride(1), D=D, BD=BD,
            BS=max(2, next_pow2(S)), HAS_SINKS=sinks is not None, num_warps=4 if BD <= 128 else 8,
        )
    return out


def split_partials(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tree_mask: torch.Tensor,
                   length: torch.Tensor, bound: int, scale: float, plan: tuple[int, int, int] | None = None,
                   window: int = 0, depths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first launch alone (``scripts/bench_tree_attention.py`` times it apart): per split, the normalised
    partial outputs ``[S, H, N, D]`` fp32 and their log-sum-exps ``[S, H, N]`` (−inf where a split saw nothing)."""
    _, H, N, D = q.shape
    HKV = keys.shape[1]
    if H % HKV:
        raise ValueError(f"{H} query heads are not a multiple of {HKV} kv heads")
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("tree_attention: the cache's last dimension must be contiguous")
    if q.stride(-1) != 1:
        q = q.contiguous()
    BM, BN, SPLIT = plan or split_plan(H, HKV, N, bound, D, q.dtype == torch.float32)
    S = triton.cdiv(bound, SPLIT)
    BD = max(16, next_pow2(D))
    o_part = torch.empty(S, H, N, D, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(S, H, N, device=q.device, dtype=torch.float32)
    mask = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask  # (a view: no copy)
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    # fp32 inputs get IEEE fp32 dots; so do 16-bit ones under the interpreter, whose tl.dot multiplies 16-bit
    # operands as raw bits (the upcast is exact)
    dot_f32 = INTERPRET or q.dtype == torch.float32
    warps = 8 if BM * BD >= 64 * 256 else 4
    with launch_ctx(INTERPRET):
        _split_kernel[(triton.cdiv((H // HKV) * N, BM), HKV, S)](
            q[0], keys[0], values[0], mask, length.reshape(1), length if depths is None else depths, o_part, lse_part,
            N, bound, H // HKV, float(scale), int(window),
            q.stride(1), q.stride(2), keys.stride(1), keys.stride(2), values.stride(1), values.stride(2),
            mask.stride(0), o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0),
            lse_part.stride(1), D=D, BD=BD, BM=BM, BN=BN, SPLIT=SPLIT, DOT_F32=dot_f32, HAS_DEPTHS=depths is not None,
            num_warps=warps, num_stages=2,
        )
    return o_part, lse_part

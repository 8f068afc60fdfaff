"""Triton kernels for one Weaver expansion round's bookkeeping (references in :mod:`.naive`).

The torch form of a round's bookkeeping is ~25 small kernels (a gather of ``M × P`` lm_head rows materialised, a
batched matmul, log-softmax, two top-k's with their sorts, a dozen index reads and writes), whose time is mostly
launches and dependent small kernels. Here it is two:

1. ``_pool_scores_kernel``, grid (M, P / BP): each program gathers BP lm_head rows of one node's pool and dots them
   with the node's query (fp32 accumulation; the reference rounds the dot to the weight dtype first, as the
   batched matmul does), plus the pool's DFlash logits.
2. ``_expand_kernel``, one program per node of the round: a log-softmax over its P scores and its ``fan`` best
   children by repeated argmax (lowest index first among equal values, as the reference's stable sort; values equal
   to the reference's to fp32 rounding: exp/log are the GPU's), published to the frontier; the program that arrives
   last (an atomic count) then completes a spine's path scores and makes the ``take`` best frontier entries the next
   nodes (token, parent, logq, depth, score, mask row), which leave the frontier — the selection is over the whole
   frontier, a few dozen block reductions in one program. (One program per node, not one for the whole round:
   that one ran the round's nodes in series; BENCHMARKS.md, Kernels.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import INTERPRET, add, maximum, minimum
from ..utils import launch_ctx, next_pow2, zeroed_scratch


@triton.jit
def _pool_scores_kernel(query, rows, pool_ids, pool_logits, weight, out, P, Dm, s_q, s_ids, s_pl, s_w,
                        BP: tl.constexpr, BK: tl.constexpr):
    m, pb = tl.program_id(0), tl.program_id(1)
    cols = pb * BP + tl.arange(0, BP)
    ok = cols < P
    row = tl.load(rows + m)
    tok = tl.load(pool_ids + row * s_ids + cols, mask=ok, other=0).to(tl.int64)
    acc = tl.full([BP], 0.0, tl.float32)
    for k0 in range(0, Dm, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < Dm
        q = tl.load(query + m * s_q + ks, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(weight + tok[:, None] * s_w + ks[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.reduce(w.to(tl.float32) * q[None, :], 1, add)
    base = tl.load(pool_logits + row * s_pl + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + m * P + cols, acc + base, mask=ok)


@triton.jit
def _expand_kernel(cand, pool_ids, tokens, parents, logq, depth, score, mask, f_score, f_token, f_logq, arrivals,
                   lo, hi, take, max_depth, spine, P, n, s_cand, s_ids,
                   FAN: tl.constexpr, BFAN: tl.constexpr, BP: tl.constexpr, BF: tl.constexpr, BN: tl.constexpr):
    neg_inf = float("-inf")
    # 1. program i publishes node lo + i's children
    i = tl.program_id(0)
    node = lo + i
    cols = tl.arange(0, BP)
    c_ok = cols < P
    d = tl.load(depth + node)
    # padding nodes (parent -1, except the root) and nodes at the maximum depth publish nothing
    publish = (tl.load(parents + node) >= 0) | (node == 0)
    publish = publish & (d < max_depth)
    row = tl.minimum(d, max_depth - 1)
    x = tl.load(cand + i * s_cand + cols, mask=c_ok, other=neg_inf)
    top = tl.reduce(x, 0, maximum)
    lp = (x - top) - tl.log(tl.reduce(tl.exp(x - top), 0, add))  # log-softmax in torch's order of operations
    # A spine node's path score is not known yet (its parent is published by another program): its entries are
    # published relative to it and completed in step 2. A spine parent's first candidate is its spine child.
    s = tl.where((node >= 1) & (node <= spine), 0.0, tl.load(score + node))
    tl.store(logq + node + 1, tl.reduce(tl.where(cols == 0, lp, neg_inf), 0, maximum), mask=node < spine)
    free = c_ok & ((cols != 0) | (node >= spine))  # not yet taken: among equal values (even -inf ones) the lowest
    # free index goes first
    for j in tl.static_range(FAN):
        v = tl.reduce(tl.where(free, lp, neg_inf), 0, maximum)
        idx = tl.reduce(tl.where(free & (lp == v), cols, BP), 0, minimum)
        slot = node * FAN + j
        tl.store(f_score + slot, tl.where(publish, s + v, neg_inf))
        tl.store(f_token + slot, tl.load(pool_ids + row * s_ids + idx, mask=idx < P, other=0))
        tl.store(f_logq + slot, v)
        free = free & (cols != idx)
    # 2. the program that arrives last (an acq_rel atomic orders every program's stores before its reads, which go
    # past L1) completes the spine and takes the next nodes; it leaves the arrival count zeroed for the next launch
    tl.debug_barrier()
    if tl.atomic_add(arrivals, 1) == hi - lo - 1:
        tl.store(arrivals, 0)
        fan = tl.arange(0, BFAN)
        f_ok = fan < FAN
        s = tl.load(score)
        for k in range(0, spine):  # path scores down the spine, in node order (the reference's running sum)
            s = s + tl.load(logq + k + 1, cache_modifier=".cg")
            tl.store(score + k + 1, s)
            rel = tl.load(f_score + (k + 1) * FAN + fan, mask=f_ok, cache_modifier=".cg")
            tl.store(f_score + (k + 1) * FAN + fan, s + rel, mask=f_ok)
        tl.debug_barrier()  # the frontier stores above are read below (other threads of this program)
        fcols = tl.arange(0, BF)
        taken = fcols >= n * FAN
        F = tl.load(f_score + fcols, mask=~taken, other=neg_inf, cache_modifier=".cg")
        nodes = tl.arange(0, BN)
        n_ok = nodes < n
        for t in range(0, take):
            v = tl.reduce(tl.where(taken, neg_inf, F), 0, maximum)
            idx = tl.reduce(tl.where(~taken & (F == v), fcols, BF), 0, minimum)
            valid = v > neg_inf
            parent = idx // FAN
            new = hi + t
            tl.store(tokens + new, tl.where(valid, tl.load(f_token + idx, cache_modifier=".cg"), 0))
            tl.store(parents + new, tl.where(valid, parent, -1))
            tl.store(logq + new, tl.where(valid, tl.load(f_logq + idx, cache_modifier=".cg"), neg_inf))
            tl.store(depth + new, tl.where(valid, tl.load(depth + parent) + 1, 0))
            tl.store(score + new, v)
            tl.store(f_score + idx, neg_inf)  # taken
            taken = taken | (fcols == idx)
            ancestors = tl.where(valid, tl.load(mask + parent * n + nodes, mask=n_ok, other=0), 0)
            tl.store(mask + new * n + nodes, tl.where(nodes == new, 1, ancestors).to(tl.uint8), mask=n_ok)


def pool_scores_triton(query: torch.Tensor, rows: torch.Tensor, pool_ids: torch.Tensor, pool_logits: torch.Tensor,
                       weight: torch.Tensor, BP: int = 4, BK: int = 512, num_warps: int = 4,
                       num_stages: int = 2) -> torch.Tensor:
    """Same contract as :func:`..naive.pool_scores_ref` (fp32 dot, not rounded to the weight dtype). ``BP``
    candidates per program, ``BK`` model dims per loop step (``scripts/bench_weaver_round.py`` sweeps them)."""
    M, Dm = query.shape
    P = pool_ids.shape[1]
    rows = rows.contiguous()
    if weight.stride(-1) != 1 or query.stride(-1) != 1 or pool_ids.stride(-1) != 1 or pool_logits.stride(-1) != 1:
        raise ValueError("pool_scores: last dimensions must be contiguous")
    out = torch.empty(M, P, device=query.device, dtype=torch.float32)
    with launch_ctx(INTERPRET):
        _pool_scores_kernel[(M, triton.cdiv(P, BP))](
            query, rows, pool_ids, pool_logits, weight, out, P, Dm, query.stride(0), pool_ids.stride(0),
            pool_logits.stride(0), weight.stride(0), BP=BP, BK=BK, num_warps=num_warps, num_stages=num_stages,
        )
    return out


def weaver_expand_triton(cand, pool_ids, tokens, parents, logq, depth, score, mask, f_score, f_token, f_logq,
                         lo: int, hi: int, take: int, max_depth: int, spine: int = 0, num_warps: int = 1) -> None:
    """Same contract as :func:`..naive.weaver_expand_ref` (buffers written in place)."""
    n = tokens.shape[0]
    fan = f_score.shape[0] // n
    P = cand.shape[1]
    for t in (tokens, parents, logq, depth, score, mask, f_score, f_token, f_logq, cand, pool_ids):
        if not t.is_contiguous():
            raise ValueError("weaver_expand: buffers must be contiguous")
    m = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    arrivals = zeroed_scratch(cand.device, (1,), torch.int32)
    with launch_ctx(INTERPRET):
        _expand_kernel[(hi - lo,)](
            cand, pool_ids, tokens, parents, logq, depth, score, m, f_score, f_token, f_logq, arrivals,
            lo, hi, take, max_depth, spine, P, n, cand.stride(0), pool_ids.stride(0),
            FAN=fan, BFAN=next_pow2(fan), BP=next_pow2(P), BF=next_pow2(n * fan), BN=next_pow2(n),
            num_warps=num_warps,
        )

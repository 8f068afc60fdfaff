"""Plain torch reference for the bookkeeping of one Weaver expansion round (``modeling_weaver.tree``, DESIGN.md §4).

A round runs the Weaver on the nodes ``lo..hi-1`` made by the previous round; then

1. :func:`pool_scores_ref` scores each node's candidate pool (the DFlash top-``P`` tokens at the children's depth):
   the pool's DFlash logits plus the rows of the target's lm_head for those tokens dotted with the node's query;
2. :func:`weaver_expand_ref` turns the scores into log-probabilities, publishes each node's ``fan`` best children to
   the frontier (slot ``node · fan + j``; none for padding nodes and nodes at the maximum depth) and, unless the
   round is the last, makes the ``take`` best frontier entries (by path log-probability) the next round's nodes
   ``hi..hi+take-1``: their token, parent, draft log-probability, depth, path score and ancestor-or-self mask row.

Every tensor is a fixed-size buffer of the tree build and is written in place, so a captured step can hold the whole
build; rounds are Python-unrolled (``lo``, ``hi``, ``take`` are ints).
"""

from __future__ import annotations

import torch
from torch import Tensor


def pool_scores_ref(query: Tensor, rows: Tensor, pool_ids: Tensor, pool_logits: Tensor, weight: Tensor) -> Tensor:
    """``[M, P]`` fp32 candidate logits of ``M`` nodes: ``WeaverModel.candidate_logits`` (what training scores with;
    a test keeps the two equal) of each node's pool row.

    Args:
        query: ``[M, d_model]`` the nodes' lm-head queries.
        rows: ``[M]`` long: each node's pool row (its children's depth − 1).
        pool_ids, pool_logits: ``[D, P]`` DFlash top-``P`` tokens and their logits per depth.
        weight: ``[V, d_model]`` the target's lm_head weight (only the pool's rows are read).
    """
    ids = pool_ids[rows]
    lm_rows = weight[ids]  # [M, P, d_model]
    residual = torch.matmul(lm_rows, query.to(lm_rows.dtype).unsqueeze(-1)).squeeze(-1)
    return pool_logits[rows].float() + residual.float()


def weaver_expand_ref(cand: Tensor, pool_ids: Tensor, tokens: Tensor, parents: Tensor, logq: Tensor, depth: Tensor,
                      score: Tensor, mask: Tensor, f_score: Tensor, f_token: Tensor, f_logq: Tensor, lo: int, hi: int,
                      take: int, max_depth: int) -> None:
    """Publish the children of nodes ``lo..hi-1`` (scores ``cand [hi-lo, P]``) and make the next ``take`` nodes.

    Tree buffers (``n`` nodes, node 0 the root): ``tokens``, ``parents`` (-1: padding or root), ``logq`` (draft
    log-probability), ``depth``, ``score`` (path log-probability), ``mask [n, n]`` bool ancestor-or-self. Frontier
    buffers (``n · fan``): ``f_score`` (-inf: empty or taken), ``f_token``, ``f_logq``. A missing node (an
    exhausted frontier) becomes a padding root: token 0, parent -1, logq -inf, depth 0, its mask row itself only.
    """
    n = tokens.shape[0]
    fan = f_score.shape[0] // n
    neg_inf = float("-inf")
    d = depth[lo:hi]
    ids = pool_ids[d.clamp(max=max_depth - 1)]
    # stable sorts, not topk: among equal values the lowest index first, on every device (the kernel's rule)
    logp, order = torch.log_softmax(cand, dim=-1).sort(dim=-1, descending=True, stable=True)
    top_values, top_indices = logp[:, :fan], order[:, :fan]
    real = (parents[lo:hi] >= 0) | (torch.arange(lo, hi, device=d.device) == 0)  # padding nodes publish nothing
    publish = real & (d < max_depth)
    f_score[lo * fan : hi * fan] = torch.where(publish[:, None], score[lo:hi, None] + top_values, neg_inf).flatten()
    f_token[lo * fan : hi * fan] = ids.gather(-1, top_indices).flatten()
    f_logq[lo * fan : hi * fan] = top_values.flatten()
    if take == 0:
        return
    best_values, best_indices = (t[:take] for t in f_score.sort(descending=True, stable=True))
    valid = best_values > neg_inf
    parent = best_indices // fan
    new = slice(hi, hi + take)
    tokens[new] = torch.where(valid, f_token[best_indices], 0)
    parents[new] = torch.where(valid, parent, -1)
    logq[new] = torch.where(valid, f_logq[best_indices], neg_inf)
    depth[new] = torch.where(valid, depth[parent] + 1, 0)
    score[new] = best_values
    f_score.index_fill_(0, best_indices, neg_inf)  # taken
    nodes = torch.arange(n, device=tokens.device)
    mask[new] = (mask[parent] & valid[:, None]) | (nodes[None] == nodes[new, None])

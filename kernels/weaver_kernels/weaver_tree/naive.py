"""Plain torch reference for one Weaver expansion round's bookkeeping (``modeling_weaver.tree``, docs/DESIGN.md §4).

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
    # node by node: one [P, d_model] gather in cache at a time, not [M, P, d_model] at once (faster on a CPU); rows
    # unbound in one op each (a round's per-node indexing is small ops, most of its time on a CPU)
    residual = [torch.mv(weight.index_select(0, i), q) for i, q in zip(ids.unbind(0), query.to(weight.dtype).unbind(0))]
    residual = torch.stack(residual) if residual else ids.new_zeros(ids.shape, dtype=weight.dtype)
    return pool_logits[rows].float() + residual.float()


def weaver_expand_ref(cand: Tensor, pool_ids: Tensor, tokens: Tensor, parents: Tensor, logq: Tensor, depth: Tensor,
                      score: Tensor, mask: Tensor, f_score: Tensor, f_token: Tensor, f_logq: Tensor, lo: int, hi: int,
                      take: int, max_depth: int, spine: int = 0) -> None:
    """Publish the children of nodes ``lo..hi-1`` (scores ``cand [hi-lo, P]``) and make the next ``take`` nodes.

    Tree buffers (``n`` nodes, node 0 the root): ``tokens``, ``parents`` (-1: padding or root), ``logq`` (draft
    log-probability), ``depth``, ``score`` (path log-probability), ``mask [n, n]`` bool ancestor-or-self. Frontier
    buffers (``n · fan``): ``f_score`` (-inf: empty or taken), ``f_token``, ``f_logq``. A missing node (an
    exhausted frontier) becomes a padding root: token 0, parent -1, logq -inf, depth 0, its mask row itself only.

    ``spine > 0`` (only with ``lo = 0``): nodes ``1..spine`` are a chain made before the round, node ``i + 1`` being
    the first pool candidate (column 0) of node ``i``. Their ``logq`` and ``score`` come from this round's scores
    (in node order, as the kernel adds them), and nodes ``0..spine-1`` publish their other candidates only.
    """
    n = tokens.shape[0]
    fan = f_score.shape[0] // n
    neg_inf = float("-inf")
    d = depth[lo:hi]
    ids = pool_ids[d.clamp(max=max_depth - 1)]
    logp = torch.log_softmax(cand, dim=-1)
    cols = None
    if spine:
        first = logp[:spine, 0]
        logq[1 : spine + 1] = first
        # fp32 adds down the chain, in the kernel's order (cumsum may add in another); on the device: captured
        # steps run this reference too, so no host reads here
        for k in range(spine):
            score[k + 1] = score[k] + first[k]
        # A spine parent's column 0 is its spine child, no frontier candidate: looked at last, as -inf (the kernel
        # never frees it).
        P = cand.shape[1]
        is_parent = (torch.arange(lo, hi, device=cand.device) < spine)[:, None]
        cols = torch.where(is_parent, torch.arange(1, P + 1, device=cand.device) % P,
                           torch.arange(P, device=cand.device))
        logp = torch.where(is_parent & (cols == 0), neg_inf, logp.gather(-1, cols))
    # stable sorts, not topk: among equal values the lowest index first, on every device (the kernel's rule)
    logp, order = logp.sort(dim=-1, descending=True, stable=True)
    if cols is not None:
        order = cols.gather(-1, order)
    top_values, top_indices = logp[:, :fan], order[:, :fan]
    real = (parents[lo:hi] >= 0) | (torch.arange(lo, hi, device=d.device) == 0)  # padding nodes publish nothing
    publish = real & (d < max_depth)
    f_score[lo * fan : hi * fan] = torch.where(publish[:, None], score[lo:hi, None] + top_values, neg_inf).flatten()
    children = ids.gather(-1, top_indices)
    if spine:  # (the kernel's token for a slot past the candidates: 0)
        children = torch.where(is_parent & (top_indices == 0), 0, children)
    f_token[lo * fan : hi * fan] = children.flatten()
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


def rope_halves(t: Tensor, positions: Tensor, base: float) -> Tensor:
    """``t [..., M, heads, D]`` rotated as ``WeaverBlock.qkv`` does (fp32 cos/sin at ``positions [M]``, the halves of
    the head swapped, rounded back to ``t``'s dtype)."""
    D = t.shape[-1]
    inv_freq = base ** (-torch.arange(0, D, 2, dtype=torch.float32, device=t.device) / D)
    angles = positions.float()[:, None] * inv_freq  # [M, D / 2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None].to(torch.promote_types(t.dtype, torch.float32))
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None].to(cos.dtype)
    x = t.to(cos.dtype)
    swapped = torch.cat((-x[..., D // 2 :], x[..., : D // 2]), dim=-1)
    return (x * cos + swapped * sin).to(t.dtype)


def node_attention_ref(qkv: Tensor, positions: Tensor, prompt_k: Tensor, prompt_v: Tensor, node_k: Tensor,
                       node_v: Tensor, mask: Tensor, lo: int, rope_base: float, scale: float) -> Tensor:
    """One Weaver layer's attention for the ``M`` nodes of a round, from its q/k/v projection (``WeaverModel.step``'s
    unfused form: RoPE on q and k, the nodes' K/V written into their slots, then attention over the prompt and the
    node slots their mask rows allow).

    Args:
        qkv: ``[M, 3 · H · D]`` the rows of ``WeaverBlock.qkv_proj`` (``[q | k | v]``, each head-major).
        positions: ``[M]`` long RoPE positions (depth + 1).
        prompt_k, prompt_v: ``[H, P, D]`` the prompt's K/V (rotated at encoding).
        node_k, node_v: ``[H, n, D]`` node slots; rows ``lo .. lo + M - 1`` are written here.
        mask: ``[M, n]`` bool: the node slots each node sees (its ancestors and itself).
    Returns:
        ``[M, H · D]`` in ``qkv``'s dtype, the heads' outputs side by side.
    """
    M = qkv.shape[0]
    H, _, D = node_k.shape
    q, k, v = qkv.view(M, 3, H, D).unbind(1)  # [M, H, D]
    q, k = rope_halves(q, positions, rope_base), rope_halves(k, positions, rope_base)
    node_k[:, lo : lo + M] = k.transpose(0, 1).to(node_k.dtype)
    node_v[:, lo : lo + M] = v.transpose(0, 1).to(node_v.dtype)
    keys = torch.cat([prompt_k.to(q.dtype), node_k.to(q.dtype)], dim=1)  # [H, P + n, D]
    values = torch.cat([prompt_v.to(q.dtype), node_v.to(q.dtype)], dim=1)
    visible = torch.cat([torch.ones(M, prompt_k.shape[1], dtype=torch.bool, device=mask.device), mask.bool()], -1)
    attn = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=visible[None],
                                                            scale=scale)  # [H, M, D]
    return attn.transpose(0, 1).reshape(M, H * D)

"""Plain torch reference for tree attention over a static KV cache.

A verified tree's K/V sit in the cache rows ``length .. length+N-1`` right after the committed rows. Query node i
attends to every committed row and to the tree rows of its ancestors-or-self; rows past ``length + N`` (up to the
``bound`` a captured step attends over) are masked. With a sliding ``window`` a row is visible only where the query's
position minus the row's is below ``window`` (transformers' ``sliding_window_overlay``). Positions: committed row j
sits at j; query / tree row i at ``length + depths[i]`` (a verified tree), or at ``length + i`` without ``depths``
(a DFlash drafter's block). Attention ``sinks`` (GPT-OSS): one logit per head that joins each softmax's denominator
and reads no value row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def tree_attention_mask(tree_mask: Tensor, length: Tensor, bound: int, window: int = 0,
                        depths: Tensor | None = None) -> Tensor:
    """``[N, bound]`` bool: every committed row, plus the tree's own rows (after them) where ancestor-or-self; within
    the ``window`` (0: none) of each query's position (``length + depths[i]``, or ``length + i`` without ``depths``)."""
    N = tree_mask.shape[0]
    rel = torch.arange(bound, device=tree_mask.device) - length  # row offset from the tree's first slot
    in_tree = (rel >= 0) & (rel < N)
    mask = (rel < 0)[None] | (tree_mask[:, rel.clamp(0, N - 1)] & in_tree[None])
    if window > 0:
        q_pos = torch.arange(N, device=rel.device) if depths is None else depths  # (positions minus length)
        k_pos = rel if depths is None else torch.where(rel < 0, rel, depths[rel.clamp(0, N - 1)])
        mask = mask & (k_pos[None] > q_pos[:, None] - window)
    return mask


def tree_attention_ref(q: Tensor, keys: Tensor, values: Tensor, tree_mask: Tensor, length: Tensor, bound: int,
                       scale: float, window: int = 0, depths: Tensor | None = None,
                       sinks: Tensor | None = None, visible: Tensor | None = None) -> Tensor:
    """Attention of the tree's queries over the cache.

    Args:
        q: ``[1, H, N, D]`` queries (RoPE applied).
        keys, values: ``[1, HKV, L, D]`` cache, ``H`` a multiple of ``HKV`` (query head h reads kv head h // (H/HKV));
            the tree's own K/V already written at rows ``length .. length+N-1``.
        tree_mask: ``[N, N]`` bool ancestor-or-self mask.
        length: 0-d long tensor, committed rows.
        bound: rows attended over (``length + N ≤ bound ≤ L``).
        window: sliding window (0: none): a row is visible where query position − row position < ``window``.
        depths: ``[N]`` long, each node's depth (its position is ``length + depth``); None: a block, node i at
            ``length + i``. Read only with a window.
        sinks: ``[H]`` per-head sink logits (None: none).
        visible: ``[N, bound]`` bool, :func:`tree_attention_mask` of the arguments above when the caller has it
            already (None: built here).
    Returns:
        ``[1, N, H * D]`` in q's dtype (heads side by side, the o_proj input).
    """
    H, N = q.shape[1], q.shape[2]
    mask = tree_attention_mask(tree_mask, length, bound, window, depths) if visible is None else visible
    if sinks is None:
        out = F.scaled_dot_product_attention(q, keys[:, :, :bound], values[:, :, :bound], attn_mask=mask, scale=scale,
                                             enable_gqa=H != keys.shape[1])
    else:  # (SDPA has no sink column: the softmax written out, as transformers' GPT-OSS eager attention)
        group = H // keys.shape[1]
        k, v = (t[:, :, :bound].repeat_interleave(group, dim=1) for t in (keys, values))
        s = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
        s = torch.cat([s, sinks.to(s.dtype).view(1, H, 1, 1).expand(1, H, N, 1)], dim=-1)
        out = s.softmax(dim=-1)[..., :-1].to(v.dtype) @ v
    return out.transpose(1, 2).reshape(1, N, -1)

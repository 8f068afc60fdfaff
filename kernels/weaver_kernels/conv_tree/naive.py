"""Plain torch reference for the depthwise causal conv1d over a tree (docs/DESIGN.md §5).

Node i convolves ``[x_anc(W-1)(i), …, x_parent(i), x_i]``: its nearest ancestors, continued above the root by the
committed window. ``x [B, T, C]``, window ``[B, C, W-1]`` (oldest first), weight ``[C, W]``, parents ``[T]`` (-1 root).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def conv_tree_gather_index(parents: torch.Tensor, width: int) -> torch.Tensor:
    """Index ``[T, W]`` into ``cat(window, x)`` along time: column s holds the input ``W-1-s`` steps up the path.

    Window entries are 0..W-2, node i is W-1+i. Above the root the walk continues into the window, newest first.
    """
    T = parents.shape[0]
    cur = torch.arange(T, device=parents.device)  # in node space; negative = -r means window entry r from the end
    cols = [cur]
    for _ in range(width - 1):
        from_node = parents.clamp(min=0)[cur.clamp(min=0)]
        root_parent = parents[cur.clamp(min=0)] < 0
        cur = torch.where(cur >= 0, torch.where(root_parent, torch.full_like(cur, -1), from_node), cur - 1)
        cols.append(cur)
    return torch.stack(cols[::-1], dim=1) + (width - 1)


def conv_tree_ref(
    x: torch.Tensor,
    window: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    parents: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """``[B, T, C]`` outputs of every node; reads the committed window, writes nothing."""
    W = weight.shape[-1]
    seq = torch.cat([window.transpose(1, 2), x], dim=1).to(weight.dtype)  # [B, W-1+T, C]
    idx = conv_tree_gather_index(parents.to(x.device), W)  # [T, W]
    taps = seq[:, idx]  # [B, T, W, C]
    out = (taps * weight.T).sum(dim=2)
    if bias is not None:
        out = out + bias
    if activation == "silu":
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"unsupported activation {activation!r}")
    return out.to(x.dtype)


def conv_tree_commit_ref(window: torch.Tensor, x: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """Slide the committed window in place along the accepted ``path`` (node indices root..leaf).

    ``path`` may be right-padded with -1 (ignored; fixed-size buffers for CUDA graphs).
    """
    path = path.to(x.device)
    path = path[path >= 0]
    seq = torch.cat([window, x[:, path].transpose(1, 2).to(window.dtype)], dim=2)
    window.copy_(seq[..., -window.shape[-1] :])
    return window


def conv_decode_ref(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    activation: str | None = "silu") -> torch.Tensor:
    """One committed token ``x [B, 1, C]``: its conv output, and the window slid by it in place."""
    root = torch.full((1,), -1, dtype=torch.long, device=x.device)
    out = conv_tree_ref(x, window, weight, bias, root, activation)
    conv_tree_commit_ref(window, x, torch.zeros(1, dtype=torch.long, device=x.device))
    return out

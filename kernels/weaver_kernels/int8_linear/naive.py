"""Torch reference of the int8-weight linear: per-output-row symmetric quantisation and the product it stands for.

``quantize_rows(w [N, K]) → (q int8 [N, K], scale fp32 [N])`` with ``w ≈ q · scale[:, None]``, ``scale = max|w_row| /
127``; ``int8_linear_ref(x [M, K], q, scale) = (x @ q.T) · scale`` in fp32, cast to x's dtype. int8 values are exact
in bf16, so a kernel that multiplies bf16 inputs by the int8 weights converted to bf16 and accumulates in fp32 computes
the same sum, in another order.
"""

from __future__ import annotations

import torch


def quantize_rows(weight: torch.Tensor, rows_per_pass: int = 16384) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 quantisation of ``weight [N, K]`` (in passes of ``rows_per_pass`` rows: no fp32 copy of
    the whole weight). Zero rows get scale 1."""
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for i in range(0, weight.shape[0], rows_per_pass):
        w = weight[i : i + rows_per_pass].detach().float()
        s = w.abs().amax(dim=1) / 127.0
        s = torch.where(s > 0, s, torch.ones_like(s))
        q[i : i + w.shape[0]] = torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8)
        scale[i : i + w.shape[0]] = s
    return q, scale


def int8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` times the dequantised ``q [N, K] · scale [N]`` → ``[..., N]`` in x's dtype (fp32 sums)."""
    out = torch.matmul(x.float(), q.float().T) * scale
    return out.to(x.dtype)

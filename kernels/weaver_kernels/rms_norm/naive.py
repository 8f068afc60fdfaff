"""Torch reference of the RMSNorm forms the targets use, op for op as transformers computes them (so that the
reference equals the modules bit for bit; the kernel in :mod:`.fused` matches it to rounding).

``kind``:
    0 — Llama / Qwen2 / Qwen3 ``RMSNorm``: ``w · cast(x̂)``, the product in the weight/input dtype.
    1 — Qwen3.5 ``RMSNorm``: ``cast(x̂ · (1 + w))`` in fp32.
    2 — Qwen3.5 ``RMSNormGated``: ``cast((w · cast(x̂)) · silu(gate))``.
    3 — KimiLinear ``RMSNormGated`` (the KDA output norm): ``cast((w · x̂) · sigmoid(gate))``, all in fp32.
with ``x̂ = x · rsqrt(mean(x²) + eps)`` in fp32 over the last dimension and ``cast`` to the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

WEIGHT, ONE_PLUS, GATED, GATED_SIGMOID = 0, 1, 2, 3
GATED_KINDS = (GATED, GATED_SIGMOID)  # the forms that take a gate


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None, eps: float, kind: int):
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if kind == ONE_PLUS:
        return (h * (1.0 + weight.float())).to(dtype)
    if kind == GATED_SIGMOID:  # (KimiLinear keeps the weight product in fp32: no cast before it)
        return (weight.float() * h * torch.sigmoid(gate.float())).to(dtype)
    h = weight * h.to(dtype)
    if kind == GATED:
        h = (h * F.silu(gate.float())).to(dtype)
    return h

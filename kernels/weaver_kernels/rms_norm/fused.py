"""Triton RMSNorm: one program per row, the whole row in registers (fp32), one read of x (and gate) and one write.

Replaces the 6–9 elementwise/reduction launches of a transformers RMSNorm module with one; at the Qwen3.6-27B shape a
decode step runs ~209 of them (2 per layer, q/k norms, GDN output norms, final norm). Forms and rounding points as
in :mod:`.naive` (the fp32 row sum is reduced in a different order, so results agree to rounding, not bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import INTERPRET, rsum
from ..utils import launch_ctx, next_pow2


@triton.jit
def _rms_norm_kernel(x, weight, gate, out, D, sx, sg, so, eps, KIND: tl.constexpr, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    m = cols < D
    xv = tl.load(x + row * sx + cols, mask=m, other=0.0)
    h = xv.to(tl.float32)
    h = h * (1.0 / tl.sqrt(rsum(h * h, 0) / D + eps))
    w = tl.load(weight + cols, mask=m, other=0.0).to(tl.float32)
    if KIND == 1:
        y = h * (1.0 + w)
    elif KIND == 3:
        gv = tl.load(gate + row * sg + cols, mask=m, other=0.0).to(tl.float32)
        y = w * h * (1.0 / (1.0 + tl.exp(-gv)))
    else:
        y = (w * h.to(xv.dtype).to(tl.float32)).to(xv.dtype).to(tl.float32)
        if KIND == 2:
            gv = tl.load(gate + row * sg + cols, mask=m, other=0.0).to(tl.float32)
            y = y * (gv / (1.0 + tl.exp(-gv)))
    tl.store(out + row * so + cols, y.to(out.dtype.element_ty), mask=m)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None, eps: float, kind: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., D]`` (and ``gate`` of the same shape for kinds 2 and 3) → ``[..., D]`` in x's dtype."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    g2 = x2
    if kind in (2, 3):
        g2 = gate.reshape(-1, D)
        if g2.stride(-1) != 1:
            g2 = g2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if out is None else out.view(-1, D)
    if x2.shape[0]:
        with launch_ctx(INTERPRET):
            _rms_norm_kernel[(x2.shape[0],)](
                x2, weight, g2, out, D, x2.stride(0), g2.stride(0), out.stride(0), float(eps),
                KIND=kind, BD=next_pow2(D), num_warps=4 if D <= 2048 else 8,
            )
    return out.view(x.shape)

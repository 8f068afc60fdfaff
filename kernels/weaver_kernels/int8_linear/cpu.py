"""int8 rows on a CPU: fbgemm's dynamically quantised GEMM, as torch ships it on x86.

The weight is ``quantize_rows``' own int8 values and per-row scales (prepacked once, no second rounding); the
activations are quantised per call to uint8 with one scale (7 bits: fbgemm sums pairs of products in 16 bits without
VNNI, and the reduced range keeps those from saturating), then summed in int32. So it approximates
``int8_linear_ref`` by the activations' rounding as well: a draft-only form, a quarter of an fp32 weight's bytes.
"""

from __future__ import annotations

import functools
import warnings

import torch


def cpu_int8_pack(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
    """fbgemm's prepacked form of int8 rows ``q [N, K]`` with per-row ``scale [N]`` and an optional ``bias [N]``."""
    with warnings.catch_warnings():  # (torch marks its quantized tensors deprecated; the GEMM is what is used)
        warnings.simplefilter("ignore")
        weight = torch._make_per_channel_quantized_tensor(q.detach().cpu(), scale.detach().cpu().double(),
                                                          torch.zeros(q.shape[0], dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(weight, None if bias is None else bias.detach().cpu().float())


def cpu_int8_linear(x: torch.Tensor, packed) -> torch.Tensor:
    """``x [..., K]`` times a :func:`cpu_int8_pack` weight (+ its bias) → ``[..., N]`` in x's dtype."""
    return torch.ops.quantized.linear_dynamic(x.float().contiguous(), packed, True).to(x.dtype)


@functools.cache
def cpu_int8_available() -> bool:
    """Whether this torch has the int8 GEMM on this CPU (x86 builds with fbgemm)."""
    try:
        cpu_int8_linear(torch.ones(1, 2), cpu_int8_pack(torch.ones(1, 2, dtype=torch.int8), torch.ones(1)))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True

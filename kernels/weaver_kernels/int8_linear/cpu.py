"""int8 rows on a CPU: fbgemm's int8 GEMM, as torch ships it on x86.

The weight is ``quantize_rows``' own int8 values and per-row scales (prepacked once, no second rounding). Each
activation row is rounded with its own scale: scaled to max |x| = 1, then quantised to uint8 with one fixed grid
(7 bits: fbgemm sums pairs of products in 16 bits without VNNI, and the reduced range keeps those from saturating),
summed in int32 and scaled back. A row's result is then the same whatever other rows share the call (a draft's
depth-d logits do not depend on how many depths are projected). So it approximates ``int8_linear_ref`` by the
activations' rounding as well: a draft-only form, a quarter of an fp32 weight's bytes.
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import torch

# the activations' grid: [-1, 1] in 126 steps around the zero point 64, inside fbgemm's reduced uint8 range [0, 127]
_STEP, _ZERO = 1.0 / 63, 64


class CpuInt8Weight(NamedTuple):
    """fbgemm's prepacked int8 weight (no bias: the GEMM's rows are scaled back before it is added) and the bias."""

    packed: object
    bias: torch.Tensor | None


def cpu_int8_pack(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> CpuInt8Weight:
    """The prepacked form of int8 rows ``q [N, K]`` with per-row ``scale [N]`` and an optional ``bias [N]``."""
    with warnings.catch_warnings():  # (torch marks its quantized tensors deprecated; the GEMM is what is used)
        warnings.simplefilter("ignore")
        weight = torch._make_per_channel_quantized_tensor(q.detach().cpu(), scale.detach().cpu().double(),
                                                          torch.zeros(q.shape[0], dtype=torch.long), 0)
        packed = torch.ops.quantized.linear_prepack(weight, None)
    return CpuInt8Weight(packed, None if bias is None else bias.detach().cpu().float())


def cpu_int8_linear(x: torch.Tensor, weight: CpuInt8Weight) -> torch.Tensor:
    """``x [..., K]`` times a :func:`cpu_int8_pack` weight (+ its bias) → ``[..., N]`` in x's dtype."""
    rows = x.float().reshape(-1, x.shape[-1])
    size = rows.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    out = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
        rows / size, _STEP, _ZERO, weight.packed).mul_(size)
    if weight.bias is not None:
        out += weight.bias
    return out.reshape(*x.shape[:-1], -1).to(x.dtype)


@functools.cache
def cpu_int8_available() -> bool:
    """Whether this torch has the int8 GEMM on this CPU (x86 builds with fbgemm)."""
    try:
        cpu_int8_linear(torch.ones(1, 2), cpu_int8_pack(torch.ones(1, 2, dtype=torch.int8), torch.ones(1)))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True

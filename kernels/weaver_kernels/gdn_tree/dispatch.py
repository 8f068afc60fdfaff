"""Which form the tree GDN verify takes when the caller leaves ``impl=None``, and the forms' limits: one table.

The choice follows measurements at the Qwen3.6-27B shape on the H200 (BENCHMARKS.md, Kernels): the fused form by
default; the resident form at four row blocks, where its prep launch costs less than the serial blocks save; the
Neumann form for trees whose depth the caller bounds (a block drafter's: block size − 1), at the node counts where
``depth`` dense steps beat the row blocks. Every form solves any tree exactly: the choice only moves the time.
"""

from __future__ import annotations

from ..utils import next_pow2

MAX_NODES = 256  # a budget of 128 drafts plus the root fits; the fused form's serial chain grows linearly past that
RESIDENT_MAX_NODES = 128  # K and Q of every row stay in registers
NEUMANN_MAX_NODES = 128  # the [T_pad, T_pad] coefficients stay L2-resident
RESIDENT_NODES = range(49, 65)  # four row blocks, T_pad = 64: the measured case
# deeper trees cost more Horner steps than the row blocks save (the measured break-even: BENCHMARKS.md, Kernels)
NEUMANN_MAX_DEPTH = 31
# node counts after the root step: not 65-96 (T_pad 128 for five or six row blocks) nor ≤ 48 (its fixed cost
# against two or three row blocks)
NEUMANN_NODES = (*range(49, 65), *range(97, NEUMANN_MAX_NODES + 1))
# the Horner products in single-pass tf32 for 16-bit inputs: inside the bf16 error budget ("tf32x3" nearer fp32)
NEUMANN_PRECISION = "tf32"


def fused_peels(T: int, BT: int, peel_root: bool) -> bool:
    """Whether the fused form runs node 0 as a recurrent step: where that saves a whole row block."""
    return peel_root and T > 1 and T % BT == 1


def neumann_peels(T: int, peel_root: bool) -> bool:
    """Whether the Neumann form runs node 0 as a recurrent step: where that halves its padded size."""
    return peel_root and T > 1 and next_pow2(T - 1) < next_pow2(T)


def verify_form(T: int, BT: int = 16, peel_root: bool = False, max_depth: int | None = None) -> str:
    """The form ``impl=None`` takes for a tree of ``T`` nodes: ``"neumann"``, ``"resident"`` or ``"fused"``.

    ``max_depth``: a bound on the tree's depth that the caller knows (None: unknown, no Neumann form). ``BT`` other
    than 16 and the fused form's root step (``peel_root`` where it applies) are the fused kernel's options."""
    shallow = max_depth is not None and max_depth <= NEUMANN_MAX_DEPTH
    if shallow and BT == 16 and T - neumann_peels(T, peel_root) in NEUMANN_NODES:
        return "neumann"
    if T in RESIDENT_NODES and BT == 16 and not fused_peels(T, BT, peel_root):
        return "resident"
    return "fused"


def solve_precision(impl: str, fp32_inputs: bool) -> str:
    """The default precision of the solve's dots: the Neumann form's for 16-bit inputs, else IEEE fp32."""
    return NEUMANN_PRECISION if impl == "neumann" and not fp32_inputs else "ieee"

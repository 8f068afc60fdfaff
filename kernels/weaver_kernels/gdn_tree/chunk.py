"""Triton tree gated delta rule (docs/DESIGN.md §5): rollback-free verify and accepted-path commit (:mod:`.commit`).

Verify (writes no state). For a tree of T nodes in topological order with committed state S0, per value head::

    Γ_i   = Σ_{j ∈ path(i)} g_j                     (path sums instead of cumsum: one masked row reduction)
    D_ij  = exp(Γ_i − Γ_j) if j ∈ path(i) else 0    (ancestor mask instead of tril, applied before the exp)
    A     = β ⊙ (K Kᵀ ⊙ D ⊙ M_strict)
    (I + A) U = β ⊙ (V − exp(Γ) ⊙ K S0)
    O     = scale · (exp(Γ) ⊙ Q S0 + (Q Kᵀ ⊙ D) U)

Three forms solve the masked unit-lower-triangular system, one file each: :mod:`.fused` (one launch, serial over
row blocks), :mod:`.resident` (right-looking, every row's right-hand side in registers) and :mod:`.neumann` (no row
blocks: ``depth`` dense Horner steps); :mod:`.dispatch` holds which one ``impl=None`` takes, and their limits. This
module checks the inputs, allocates the outputs and launches the chosen form.

Precision: accumulation is fp32. Products of 16-bit inputs are exact; dots with an fp32 operand (S0, U) use tf32
when q/k/v are 16-bit and IEEE fp32 when they are fp32; the row-block forms' diagonal inverse is IEEE fp32 by default
(``inverse_precision="tf32x3"`` runs it on tensor cores at about fp32 accuracy); the Neumann form's Horner products
follow ``dispatch.solve_precision``. With ``use_qk_l2norm_in_kernel`` the norms are applied as fp32 row/column
scalings of the raw dots (no re-rounding of normalised vectors).
"""

from __future__ import annotations

import torch

from ..triton_utils import INTERPRET
from ..utils import next_pow2
from .commit import gdn_tree_commit_triton
from .common import check_precision, last_contig
from .dispatch import (MAX_NODES, NEUMANN_MAX_NODES, RESIDENT_MAX_NODES, fused_peels, neumann_peels, solve_precision,
                       verify_form)
from .fused import verify_fused
from .neumann import verify_neumann
from .resident import verify_resident

__all__ = ["MAX_NODES", "gdn_tree_commit_triton", "gdn_tree_verify_triton"]

IMPLS = ("fused", "resident", "neumann")


def gdn_tree_verify_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    impl: str | None = None,
    BV: int | None = None,
    num_warps: int = 4,
    autotune: bool = False,
    BC: int | None = None,
    BT: int = 16,
    inverse_precision: str | None = None,
    o: torch.Tensor | None = None,
    u: torch.Tensor | None = None,
    gamma: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    peel_root: bool = False,
    max_depth: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of :func:`~weaver_kernels.gdn_tree.naive.gdn_tree_verify_ref` (same shapes and outputs).

    ``impl``: ``"fused"`` (one launch, serial over 16-row blocks), ``"resident"`` (two launches, right-looking with
    every row's right-hand side in registers; ≤ ``RESIDENT_MAX_NODES`` nodes), ``"neumann"`` (two launches, no row
    blocks: ``depth`` dense Horner steps; ≤ ``NEUMANN_MAX_NODES`` nodes, one more with ``peel_root``) or None: the
    form :func:`.dispatch.verify_form` picks from T, ``BT``, ``peel_root`` and ``max_depth`` — a bound on the tree's
    depth that the caller knows, e.g. a block drafter's block size − 1 (None: unknown, no Neumann form).
    ``max_depth`` only picks the form: every form solves any tree exactly (``tree_mask`` is the ancestor-or-self
    mask, transitively closed: the Neumann form reads the depth off its row counts). ``BV``/``num_warps`` pin a
    config (tests, benchmarks); by default each form launches with its measured config (no autotuner in the launch
    path), ``autotune=True`` sweeps the fused kernel's candidates with Triton's autotuner instead. ``BC`` (columns
    per inner step, default min(T_pad, 64)) is exposed for tests. ``BT``: rows per serial block of the fused kernel
    (16, 32 or 64; fewer, larger blocks shorten the serial chain at the cost of a larger diagonal inverse).
    ``inverse_precision``: of the row-block forms' diagonal inverse and solve dots (``"ieee"``: fp32 FMAs;
    ``"tf32x3"``: fp32-accurate on tensor cores; ``"tf32"``); of the Neumann form's Horner products (default
    :func:`.dispatch.solve_precision`). ``o``/``u``/``gamma`` may be given as preallocated contiguous outputs
    (static buffers for CUDA graphs; poisoned buffers in tests). With ``A_log`` and ``dt_bias`` (``[HV]``), ``g`` and
    ``beta`` are the raw gate projections a and b: the kernels form the gates themselves
    (:func:`~weaver_kernels.gdn_tree.naive.gdn_gates`' formula). ``peel_root`` (fused form at T = BT·n + 1,
    Neumann form at T = 2^n + 1, e.g. a budget of 16n drafts plus the root): node 0 runs as one recurrent step. The
    fused kernel does so when it finds node 0 an ancestor of every node and then solves n row blocks instead of
    n + 1; the Neumann form folds it into the rows that descend from it (any forest), halving T_pad. Off here by
    default; the decoding loop's GDN layers turn it on (``GatedDeltaNetLayerCache.peel_root``).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if HV % H:
        raise ValueError(f"value heads ({HV}) must be a multiple of q/k heads ({H})")
    if T > MAX_NODES:
        raise ValueError(f"gdn_tree_verify_triton supports at most {MAX_NODES} nodes, got {T}")
    if tuple(tree_mask.shape) != (T, T):
        raise ValueError(f"tree_mask must be [{T}, {T}], got {tuple(tree_mask.shape)}")
    scale = K**-0.5 if scale is None else float(scale)
    raw = A_log is not None
    if raw != (dt_bias is not None):
        raise ValueError("gdn_tree_verify: A_log and dt_bias go together")
    if raw and (A_log.numel() != HV or dt_bias.numel() != HV):
        raise ValueError(f"gdn_tree_verify: A_log and dt_bias must hold {HV} values (one per value head)")
    q, k, v = last_contig(q), last_contig(k), last_contig(v)
    s0 = initial_state.contiguous()
    mask = tree_mask.contiguous()
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    o = torch.empty((B, T, HV, V), dtype=v.dtype, device=v.device) if o is None else o
    u = torch.empty((B, T, HV, V), dtype=torch.float32, device=v.device) if u is None else u
    gamma = torch.empty((B, T, HV), dtype=torch.float32, device=v.device) if gamma is None else gamma
    for name, t, shape in (("o", o, (B, T, HV, V)), ("u", u, (B, T, HV, V)), ("gamma", gamma, (B, T, HV))):
        if tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {shape} tensor")
    if u.dtype != torch.float32 or gamma.dtype != torch.float32:
        raise ValueError("u and gamma must be float32")
    TP = max(16, next_pow2(T))
    if BT not in (16, 32, 64):
        raise ValueError(f"BT must be 16, 32 or 64, got {BT}")
    common = dict(
        H=H, HV=HV, K=K, V=V, TP=TP, BK=max(16, next_pow2(K)), BT=BT, LOG2_BT=BT.bit_length() - 1,
        BC=min(TP, 64) if BC is None else BC, L2NORM=bool(use_qk_l2norm_in_kernel),
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        # Triton's interpreter multiplies 16-bit dot operands as raw bit patterns: upcast there (exact anyway)
        DOT_F32=INTERPRET or q.dtype == torch.float32,
    )
    args = (
        q, k, v, g, beta, s0, mask, o, u, gamma, A_log.contiguous() if raw else s0,
        dt_bias.contiguous() if raw else s0, T, scale,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        g.stride(0), g.stride(1), g.stride(2),
        beta.stride(0), beta.stride(1), beta.stride(2),
    )
    if impl is None:
        impl = verify_form(T, BT, peel_root, max_depth)
    if inverse_precision is None:
        inverse_precision = solve_precision(impl, q.dtype == torch.float32)
    check_precision(inverse_precision)
    if impl == "fused":
        verify_fused(args, common, raw, inverse_precision, BV, num_warps, autotune, fused_peels(T, BT, peel_root))
    elif impl == "resident":
        if TP > RESIDENT_MAX_NODES:
            raise ValueError(f"impl='resident' takes at most {RESIDENT_MAX_NODES} nodes, got {T}")
        if BT != 16 or fused_peels(T, BT, peel_root):
            raise ValueError("impl='resident' has 16-row blocks and no root step (BT and peel_root are the fused "
                             f"kernel's), got BT={BT}, peel_root={peel_root} at T={T}")
        verify_resident(args, common, raw, inverse_precision, BV, num_warps)
    elif impl == "neumann":
        peel = neumann_peels(T, peel_root)
        if next_pow2(T - peel) > NEUMANN_MAX_NODES or BT != 16:
            raise ValueError(f"impl='neumann' takes at most {NEUMANN_MAX_NODES} nodes ({NEUMANN_MAX_NODES} + 1 with "
                             f"peel_root) and has no row blocks (BT is the fused kernel's), got T={T}, BT={BT}")
        verify_neumann(args, common, raw, inverse_precision, BV, num_warps, int(peel))
    else:
        raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")
    return o, u, gamma

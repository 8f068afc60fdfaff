"""Plain torch references for the tree gated delta rule (docs/DESIGN.md §5).

Shapes follow fla (batch first, time second): q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g and beta ``[B, T, HV]``,
state ``[B, HV, K, V]`` (fp32). ``HV`` is a multiple of ``H``: value head ``h`` reads q/k head ``h // (HV // H)``.
The tree is an ancestor-or-self mask ``[T, T]`` over nodes in topological order (ancestors before descendants),
shared by the batch. Everything is computed in fp32 (or the inputs' wider dtype); :func:`gdn_gates` keeps
transformers' dtypes (β in b's dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..rms_norm.naive import GATED, rms_norm_ref


def _acc(x: torch.Tensor) -> torch.Tensor:
    """Accumulation dtype: fp32, or fp64 when the input is fp64 (for high-precision references)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _expand_qk(x: torch.Tensor, num_v_heads: int, use_l2norm: bool) -> torch.Tensor:
    """[B, T, H, K] -> fp32 [B, HV, T, K], l2-normalised if asked."""
    x = _acc(x)
    if use_l2norm:
        x = _l2norm(x)
    return x.repeat_interleave(num_v_heads // x.shape[2], dim=2).transpose(1, 2)


def gdn_tree_verify_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Outputs of every tree node from the committed state, without writing any state.

    Returns ``o [B, T, HV, V]`` (dtype of v), ``u [B, T, HV, V]`` fp32 (the solved deltas) and
    ``gamma [B, T, HV]`` fp32 (path sums of g); ``u`` and ``gamma`` are what the commit needs. With ``A_log`` and
    ``dt_bias`` (``[HV]``), ``g`` and ``beta`` are the raw gate projections a and b (:func:`gdn_gates`).
    """
    if A_log is not None:
        g, beta = gdn_gates(g, beta, A_log, dt_bias)
    B, T, H, K = q.shape
    HV = v.shape[2]
    if HV % H:
        raise ValueError(f"value heads ({HV}) must be a multiple of q/k heads ({H})")
    scale = K**-0.5 if scale is None else scale
    qf = _expand_qk(q, HV, use_qk_l2norm_in_kernel)  # [B, HV, T, K]
    kf = _expand_qk(k, HV, use_qk_l2norm_in_kernel)
    vf = _acc(v).transpose(1, 2)  # [B, HV, T, V]
    gf = _acc(g).transpose(1, 2)  # [B, HV, T]
    bf = _acc(beta).transpose(1, 2)
    S0 = _acc(initial_state)

    incl = tree_mask.to(device=q.device, dtype=torch.bool)
    strict = incl & ~torch.eye(T, dtype=torch.bool, device=q.device)
    gamma = gf @ incl.to(gf.dtype).T  # Γ_i = Σ_{j ∈ path(i)} g_j
    # D_ij = exp(Γ_i − Γ_j) on path(i) only; masked before the exp so off-path entries never overflow.
    diff = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~incl, float("-inf"))
    decay = diff.exp()
    eg = gamma.exp()[..., None]  # [B, HV, T, 1]

    A = bf[..., None] * decay * (kf @ kf.transpose(-1, -2)) * strict
    rhs = bf[..., None] * (vf - eg * (kf @ S0))
    eye = torch.eye(T, dtype=A.dtype, device=A.device)
    u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)

    o = eg * (qf @ S0) + ((qf @ kf.transpose(-1, -2)) * decay) @ u
    o = (scale * o).transpose(1, 2).to(v.dtype)
    return o, u.transpose(1, 2).contiguous(), gamma.transpose(1, 2).contiguous()


def gdn_tree_commit_ref(
    state: torch.Tensor,
    k: torch.Tensor,
    u: torch.Tensor,
    gamma: torch.Tensor,
    path: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = False,
) -> torch.Tensor:
    """Advance ``state`` in place along the accepted ``path`` (node indices root..leaf) and return it.

    ``S* = exp(Γ_ℓ) S0 + Σ_{j ∈ path} exp(Γ_ℓ − Γ_j) k_j u_jᵀ`` with ℓ = path[-1]: no re-solve, no speculative state.
    ``path`` may be right-padded with -1 (ignored; fixed-size buffers for CUDA graphs).
    """
    path = path.to(k.device)
    path = path[path >= 0]
    if path.numel() == 0:
        return state
    HV = state.shape[1]
    kp = _expand_qk(k[:, path], HV, use_qk_l2norm_in_kernel)  # [B, HV, L, K]
    up = _acc(u[:, path]).transpose(1, 2)  # [B, HV, L, V]
    gp = _acc(gamma[:, path]).transpose(1, 2)  # [B, HV, L]
    last = gp[..., -1:]
    new = last.exp()[..., None] * _acc(state) + (kp * (last - gp).exp()[..., None]).transpose(-1, -2) @ up
    state.copy_(new)
    return state


def gdn_recurrent_ref(q, k, v, g, beta, initial_state, scale=None, use_qk_l2norm_in_kernel=False):
    """Token-by-token recurrence over a sequence (the ground truth for chains): returns (o, final_state)."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    scale = K**-0.5 if scale is None else scale
    qf = _expand_qk(q, HV, use_qk_l2norm_in_kernel)
    kf = _expand_qk(k, HV, use_qk_l2norm_in_kernel)
    vf, gf, bf = _acc(v).transpose(1, 2), _acc(g).transpose(1, 2), _acc(beta).transpose(1, 2)
    S = _acc(initial_state).clone()
    out = []
    for t in range(T):
        S = S * gf[..., t, None, None].exp()
        kt = kf[..., t, :]
        delta = bf[..., t, None] * (vf[..., t, :] - (kt[..., None] * S).sum(-2))
        S = S + kt[..., :, None] * delta[..., None, :]
        out.append(scale * (qf[..., t, :, None] * S).sum(-2))
    return torch.stack(out, dim=2).transpose(1, 2).to(v.dtype), S


def gdn_decode_ref(q, k, v, g, beta, state, norm_weight=None, gate=None, scale=None, eps=1e-6,
                   use_qk_l2norm_in_kernel=False, A_log=None, dt_bias=None):
    """One committed token (``T = 1``): returns o ``[B, 1, HV, V]`` and advances ``state`` in place. With
    ``norm_weight``, o goes through the gated RMSNorm (``rms_norm.naive``, kind GATED) with ``gate [B, 1, HV, V]``.
    With ``A_log`` and ``dt_bias`` (``[HV]``), ``g`` and ``beta`` are the raw gate projections a and b, and the gates
    are Qwen3.5's: ``g = −exp(A_log) · softplus(a + dt_bias)`` (fp32 at least), ``β = sigmoid(b)`` in b's dtype."""
    if A_log is not None:
        g, beta = gdn_gates(g, beta, A_log, dt_bias)
    o, new = gdn_recurrent_ref(q, k, v, g, beta, state, scale, use_qk_l2norm_in_kernel)
    state.copy_(new)
    if norm_weight is not None:
        o = rms_norm_ref(o, norm_weight, gate, eps, GATED)
    return o


def gdn_gates(a, b, A_log, dt_bias):
    """Qwen3.5's Gated DeltaNet gates from the raw projections, as transformers computes them: ``(g, β)``."""
    acc = torch.promote_types(a.dtype, torch.float32)
    return -A_log.to(acc).exp() * F.softplus(a.to(acc) + dt_bias), b.sigmoid()

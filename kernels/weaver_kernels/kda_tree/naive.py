"""Plain torch references for the tree Kimi Delta Attention (KDA) rule (docs/DESIGN.md §13).

KDA is the gated delta rule with a per-channel decay: ``g [B, T, HV, K]`` (log space) instead of one scalar per head.
Shapes follow fla like ``gdn_tree.naive``: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g ``[B, T, HV, K]``, beta
``[B, T, HV]``, state ``[B, HV, K, V]`` (fp32). ``HV`` is a multiple of ``H``: value head ``h`` reads q/k head
``h // (HV // H)`` (transformers' KimiLinear has ``HV = H``). The tree is an ancestor-or-self mask ``[T, T]`` over
nodes in topological order, shared by the batch; roots may be several (a forest). Everything is computed in fp32, or
fp64 for fp64 inputs; :func:`kda_gates` keeps transformers' dtypes (β in b's dtype).
"""

from __future__ import annotations

import torch

from ..gdn_tree.naive import _acc, _expand_qk


def _heads_last(x: torch.Tensor) -> torch.Tensor:
    """[B, T, HV, ...] -> accumulation dtype [B, HV, T, ...]."""
    return _acc(x).transpose(1, 2)


def kda_tree_verify_ref(
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
    ``gamma [B, T, HV, K]`` fp32 (per-channel path sums of g); ``u`` and ``gamma`` are what the commit needs. With
    ``A_log`` and ``dt_bias``, ``g`` and ``beta`` are the raw gate projections f and b (:func:`kda_gates`).
    """
    if A_log is not None:
        g, beta = kda_gates(g, beta, A_log, dt_bias)
    B, T, H, K = q.shape
    HV = v.shape[2]
    if HV % H:
        raise ValueError(f"value heads ({HV}) must be a multiple of q/k heads ({H})")
    if g.shape != (B, T, HV, K):
        raise ValueError(f"g must be per channel [B, T, HV, K] = {(B, T, HV, K)}, got {tuple(g.shape)}")
    scale = K**-0.5 if scale is None else scale
    qf = _expand_qk(q, HV, use_qk_l2norm_in_kernel)  # [B, HV, T, K]
    kf = _expand_qk(k, HV, use_qk_l2norm_in_kernel)
    vf = _heads_last(v)  # [B, HV, T, V]
    gf = _heads_last(g)  # [B, HV, T, K]
    bf = _heads_last(beta)  # [B, HV, T]
    S0 = _acc(initial_state)

    incl = tree_mask.to(device=q.device, dtype=torch.bool)
    strict = incl & ~torch.eye(T, dtype=torch.bool, device=q.device)
    gamma = torch.einsum("ij,bhjc->bhic", incl.to(gf.dtype), gf)  # Γ_i = Σ_{j ∈ path(i)} g_j, per channel
    # D_ijc = exp(Γ_ic − Γ_jc) on path(i) only; masked before the exp so off-path entries never overflow.
    diff = (gamma[:, :, :, None, :] - gamma[:, :, None, :, :]).masked_fill(~incl[:, :, None], float("-inf"))
    decay = diff.exp()  # [B, HV, T, T, K]
    eg = gamma.exp()  # [B, HV, T, K]

    A = bf[..., None] * torch.einsum("bhic,bhjc,bhijc->bhij", kf, kf, decay) * strict
    rhs = bf[..., None] * (vf - (kf * eg) @ S0)
    eye = torch.eye(T, dtype=A.dtype, device=A.device)
    u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)

    o = (qf * eg) @ S0 + torch.einsum("bhic,bhjc,bhijc->bhij", qf, kf, decay) @ u
    o = (scale * o).transpose(1, 2).to(v.dtype)
    return o, u.transpose(1, 2).contiguous(), gamma.transpose(1, 2).contiguous()


def kda_tree_commit_ref(
    state: torch.Tensor,
    k: torch.Tensor,
    u: torch.Tensor,
    gamma: torch.Tensor,
    path: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = False,
) -> torch.Tensor:
    """Advance ``state`` in place along the accepted ``path`` (node indices root..leaf) and return it.

    ``S* = Diag(exp(Γ_ℓ)) S0 + Σ_{j ∈ path} (k_j ⊙ exp(Γ_ℓ − Γ_j)) u_jᵀ`` with ℓ = path[-1]: no re-solve, no
    speculative state. ``path`` may be right-padded with -1 (ignored; fixed-size buffers for CUDA graphs). The padding
    is masked, not filtered out, and the path length stays on the device: no host sync, so a CUDA graph can capture
    it (the op runs this reference on CUDA too).
    """
    path = path.to(k.device)
    valid = path >= 0
    count = valid.sum()
    nodes = path.clamp(min=0)
    leaf = nodes.gather(0, (count - 1).clamp(min=0).reshape(1))
    HV = state.shape[1]
    kp = _expand_qk(k[:, nodes], HV, use_qk_l2norm_in_kernel)  # [B, HV, L, K]
    up = _heads_last(u[:, nodes])  # [B, HV, L, V]
    gp = _heads_last(gamma[:, nodes])  # [B, HV, L, K]
    last = _heads_last(gamma[:, leaf])  # Γ_ℓ [B, HV, 1, K]
    decay = (last - gp).masked_fill(~valid[:, None], float("-inf")).exp()  # 0 on the padding
    new = last.exp().transpose(-1, -2) * _acc(state) + (kp * decay).transpose(-1, -2) @ up
    state.copy_(torch.where(count > 0, new, _acc(state)))
    return state


def kda_recurrent_ref(q, k, v, g, beta, initial_state, scale=None, use_qk_l2norm_in_kernel=False):
    """Token-by-token KDA recurrence over a sequence (the ground truth for chains): returns (o, final_state).

    ``S_t = (I − β_t k_t k_tᵀ) Diag(exp(g_t)) S_{t−1} + β_t k_t v_tᵀ``, ``o_t = scale · S_tᵀ q_t``: decay first, then
    the delta update, as transformers' ``recurrent_kimi_delta_attention`` orders them."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    scale = K**-0.5 if scale is None else scale
    qf = _expand_qk(q, HV, use_qk_l2norm_in_kernel)
    kf = _expand_qk(k, HV, use_qk_l2norm_in_kernel)
    vf, gf, bf = _heads_last(v), _heads_last(g), _heads_last(beta)
    S = _acc(initial_state).clone()
    out = []
    for t in range(T):
        S = S * gf[..., t, :, None].exp()  # row c of S (key channel c) decays by exp(g_tc)
        kt = kf[..., t, :]
        delta = bf[..., t, None] * (vf[..., t, :] - (kt[..., None] * S).sum(-2))
        S = S + kt[..., :, None] * delta[..., None, :]
        out.append(scale * (qf[..., t, :, None] * S).sum(-2))
    return torch.stack(out, dim=2).transpose(1, 2).to(v.dtype), S


def kda_decode_ref(q, k, v, g, beta, state, scale=None, use_qk_l2norm_in_kernel=False, A_log=None, dt_bias=None):
    """One committed token (``T = 1``): returns o ``[B, 1, HV, V]`` and advances ``state`` in place (the AR step's
    verify + commit in one). With ``A_log`` and ``dt_bias``, ``g`` and ``beta`` are the raw projections f and b
    (:func:`kda_gates`)."""
    if A_log is not None:
        g, beta = kda_gates(g, beta, A_log, dt_bias)
    o, new = kda_recurrent_ref(q, k, v, g, beta, state, scale, use_qk_l2norm_in_kernel)
    state.copy_(new)
    return o


def kda_gates(f, b, A_log, dt_bias):
    """KimiLinear's KDA gates from the raw projections, as transformers computes them: ``(g, β)``.

    ``f [B, T, HV, K]``: the forget gate's low-rank projection ``f_b_proj(f_a_proj(x))``; ``b [B, T, HV]``:
    ``b_proj(x)``; ``A_log``: HV entries (transformers' ``[1, 1, HV, 1]``); ``dt_bias``: HV·K entries.
    ``g = −exp(A_log) · softplus(f + dt_bias)`` in fp32 at least, ``β = sigmoid(b)`` in b's dtype."""
    HV, K = f.shape[-2], f.shape[-1]
    acc = torch.promote_types(f.dtype, torch.float32)
    x = f.to(acc) + dt_bias.to(acc).reshape(HV, K)
    # transformers' own softplus, log(1 + exp(x)) below 20 (not log1p), so the gates match the module bit for bit
    sp = torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))
    return -A_log.to(acc).reshape(HV, 1).exp() * sp, b.sigmoid()

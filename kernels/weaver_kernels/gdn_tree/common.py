"""Pieces the tree GDN kernels share: Qwen3.5's gates from the raw projections, the root as one recurrent step, a row
block's diagonal inverse, and the launchers' argument checks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import rsum


@triton.jit
def gate_decay(a, a_log, dt_bias, i_hv):
    """Qwen3.5's g of value head ``i_hv`` from the raw projection a: −exp(A_log) · softplus(a + dt_bias).

    softplus(x) = max(x, 0) + log1p(exp(−|x|)), log1p by Kahan's correction (no log1p builtin): a plain
    log(1 + e) loses e's digits for x ≪ 0, where long-memory heads sit. Past x ≈ 17 it is x in fp32, as
    F.softplus's linear branch."""
    x = a + tl.load(dt_bias + i_hv).to(tl.float32)
    e = tl.exp(-tl.abs(x))
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
    return -tl.exp(tl.load(a_log + i_hv).to(tl.float32)) * (tl.maximum(x, 0.0) + log1p)


@triton.jit
def gate_beta(b, dtype: tl.constexpr):
    """β = sigmoid(b) of the raw projection, rounded to b's dtype (as the module computes it), as fp32."""
    return (1.0 / (1.0 + tl.exp(-b))).to(dtype).to(tl.float32)


@triton.jit
def root_step(q_base, k_base, v_base, b_base, o_k, m_k, o_v, m_v, S, g0, beta_dtype: tl.constexpr,
              L2NORM: tl.constexpr, RAW_GATES: tl.constexpr):
    """Node 0 as one recurrent step from the committed tile ``S [BK, BV]`` (the fused and Neumann forms' root step):
    its q0 and k0 (unit with L2NORM), e^{g0}, and u0 = β0 (v0 − e^{g0} k0ᵀ S); the state after it is
    e^{g0} S + k0 u0ᵀ."""
    k0 = tl.load(k_base + o_k, mask=m_k, other=0.0).to(tl.float32)
    q0 = tl.load(q_base + o_k, mask=m_k, other=0.0).to(tl.float32)
    v0 = tl.load(v_base + o_v, mask=m_v, other=0.0).to(tl.float32)
    b0 = tl.load(b_base).to(tl.float32)
    if RAW_GATES:
        b0 = gate_beta(b0, beta_dtype)
    if L2NORM:
        k0 = k0 * tl.rsqrt(rsum(k0 * k0, axis=0) + 1e-6)
        q0 = q0 * tl.rsqrt(rsum(q0 * q0, axis=0) + 1e-6)
    e0 = tl.exp(g0)
    u0 = b0 * (v0 - e0 * rsum(k0[:, None] * S, axis=0))
    return q0, k0, e0, u0


@triton.jit
def block_inverse(kk_d, D_d, b_i, BT: tl.constexpr, LOG2_BT: tl.constexpr, PREC: tl.constexpr):
    """(I + A_d)^{-1} of one row block, A_d = β ⊙ (K Kᵀ ⊙ D) strictly below the diagonal:
    Σ_{m<BT} (−A_d)^m = (I + N)(I + N²)(I + N⁴)…, N = −A_d strictly lower (N^BT = 0), i.e. 2·(LOG2_BT − 1) dots."""
    o_r = tl.arange(0, BT)
    X = -tl.where(o_r[:, None] > o_r[None, :], kk_d * D_d * b_i[:, None], 0.0)
    P = tl.where(o_r[:, None] == o_r[None, :], 1.0, 0.0) + X
    for _ in tl.static_range(LOG2_BT - 1):
        X = tl.dot(X, X, input_precision=PREC)
        P = P + tl.dot(P, X, input_precision=PREC)
    return P


def check_precision(precision: str) -> None:
    if precision not in ("ieee", "tf32x3", "tf32"):
        raise ValueError(f"precision must be 'ieee', 'tf32x3' or 'tf32', got {precision!r}")


def last_contig(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()

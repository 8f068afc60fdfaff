"""Triton kernel for one committed decoding step of the gated delta rule (the AR step), state advanced in place.

A tree of one node that is committed at once needs neither the verify's intermediates nor a separate commit: per value
head, ``S ← exp(g) S``, ``u = β (v − kᵀS)``, ``S ← S + k uᵀ``, ``o = scale · qᵀS`` read and write the state once, in one
launch instead of verify + commit (48 such layers per AR step at Qwen3.6-27B shape). With ``norm_weight`` it also
applies the layer's gated RMSNorm (Qwen3.5 ``RMSNormGated``, rounding points of ``rms_norm.naive``), which saves the
norm's launch as well — in the head's program when BV ≥ V, else in the last of the head's programs to finish (they meet
in a small scratch through atomics); with ``A_log`` / ``dt_bias`` it forms the gates g and β from the raw projections,
which saves their launch.

Grid: (V / BV, B·HV). q/k/v/gate are read through strides (views of the in_proj / conv outputs; last dim
contiguous); the state is fp32 ``[B, HV, K, V]`` contiguous. Accumulation in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import INTERPRET, head_program, lanes, rsum, state_tile
from ..utils import launch_ctx, next_pow2, zeroed_scratch
from .common import gate_beta, gate_decay


@triton.jit
def _gated_norm(h, o_v, m_v, ssq, norm_weight, gate, eps, V: tl.constexpr, dtype: tl.constexpr):
    """Qwen3.5's gated RMSNorm of one value head's ``h`` (rounded o) with the head's sum of squares ``ssq``."""
    h = h * (1.0 / tl.sqrt(ssq / V + eps))
    w = tl.load(norm_weight + o_v, mask=m_v, other=0.0).to(tl.float32)
    y = (w * h.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    zv = tl.load(gate + o_v, mask=m_v, other=0.0).to(tl.float32)
    return y * (zv / (1.0 + tl.exp(-zv)))


@triton.jit
def _gdn_decode_kernel(q, k, v, g, beta, state, o, gate, norm_weight, a_log, dt_bias, scale, eps, scratch,
                       sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sg_b, sb_b, sz_b, sz_h, so_b, so_h,
                       H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, L2: tl.constexpr, NORM: tl.constexpr, RAW_GATES: tl.constexpr,
                       NV: tl.constexpr, BVF: tl.constexpr):
    i_bh = tl.program_id(1)
    i_b, i_hv, i_h = head_program(H, HV)
    o_k, m_k = lanes(0, BK, K)
    o_v, m_v = lanes(tl.program_id(0), BV, V)
    qv = tl.load(q + i_b * sq_b + i_h * sq_h + o_k, mask=m_k, other=0.0).to(tl.float32)
    kv = tl.load(k + i_b * sk_b + i_h * sk_h + o_k, mask=m_k, other=0.0).to(tl.float32)
    if L2:
        qv = qv * (1.0 / tl.sqrt(rsum(qv * qv, 0) + 1e-6))
        kv = kv * (1.0 / tl.sqrt(rsum(kv * kv, 0) + 1e-6))
    gv = tl.load(g + i_b * sg_b + i_hv).to(tl.float32)
    bv = tl.load(beta + i_b * sb_b + i_hv).to(tl.float32)
    if RAW_GATES:  # g, beta hold the raw projections a, b: Qwen3.5's gates (transformers' formula)
        gv = gate_decay(gv, a_log, dt_bias, i_hv)
        bv = gate_beta(bv, beta.dtype.element_ty)
    vv = tl.load(v + i_b * sv_b + i_hv * sv_h + o_v, mask=m_v, other=0.0).to(tl.float32)
    s_ptr = state_tile(state, i_b, i_hv, HV, K, V) + o_k[:, None] * V + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    S = tl.load(s_ptr, mask=m_s, other=0.0) * tl.exp(gv)
    u = bv * (vv - rsum(kv[:, None] * S, 0))
    S = S + kv[:, None] * u[None, :]
    tl.store(s_ptr, S, mask=m_s)
    out = scale * rsum(qv[:, None] * S, 0)
    o_head = o + i_b * so_b + i_hv * so_h
    z_head = gate + i_b * sz_b + i_hv * sz_h
    if NORM and NV == 1:  # the whole head is here: o rounded to its dtype, then the gated RMSNorm
        h = out.to(o.dtype.element_ty).to(tl.float32)
        out = _gated_norm(h, o_v, m_v, rsum(tl.where(m_v, h * h, 0.0), 0), norm_weight, z_head, eps, V,
                          o.dtype.element_ty)
        tl.store(o_head + o_v, out.to(o.dtype.element_ty), mask=m_v)
    elif NORM:
        # The head is split over NV programs (more of the GPU streams the state): each stores its rounded slice and
        # adds its sum of squares; the program that arrives last (acq_rel atomics order the slices' stores before
        # its reads) norms the whole head and zeroes the scratch for the next launch.
        h = out.to(o.dtype.element_ty)
        tl.store(o_head + o_v, h, mask=m_v)
        hf = h.to(tl.float32)
        tl.atomic_add(scratch + 2 * i_bh, rsum(tl.where(m_v, hf * hf, 0.0), 0))
        ticket = tl.atomic_add(scratch + 2 * i_bh + 1, 1.0)
        if ticket == NV - 1:
            ssq = tl.atomic_add(scratch + 2 * i_bh, 0.0)  # every slice's sum is in: plain stores reset it
            tl.store(scratch + 2 * i_bh, 0.0)
            tl.store(scratch + 2 * i_bh + 1, 0.0)
            o_f = tl.arange(0, BVF)
            m_f = o_f < V
            hh = tl.load(o_head + o_f, mask=m_f, other=0.0, cache_modifier=".cg").to(tl.float32)
            normed = _gated_norm(hh, o_f, m_f, ssq, norm_weight, z_head, eps, V, o.dtype.element_ty)
            tl.store(o_head + o_f, normed.to(o.dtype.element_ty), mask=m_f)
    else:
        tl.store(o_head + o_v, out.to(o.dtype.element_ty), mask=m_v)


# Value columns per program. With the gated norm, a head split over several programs meets in a per-head scratch
# (sum of squares, arrival count) that the last program resets. The launch is latency-bound (a chain of loads and
# reductions), so the split gains little; with the norm 16 was the fastest measured (BENCHMARKS.md, Kernels).
DECODE_BV = 32
DECODE_NORM_BV = 16


def _heads(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.shape[1] != 1:
        raise ValueError(f"gdn_decode: {name} must hold one token, got shape {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def gdn_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, norm_weight: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                      scale: float | None = None, eps: float = 1e-6, use_qk_l2norm_in_kernel: bool = False,
                      A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                      *, BV: int | None = None, num_warps: int | None = None, out: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Triton version of :func:`~weaver_kernels.gdn_tree.naive.gdn_decode_ref`: q, k ``[B, 1, H, K]``, v (and
    gate) ``[B, 1, HV, V]``, g, beta ``[B, 1, HV]``; advances ``state`` in place; returns o ``[B, 1, HV, V]``
    (written into ``out`` when given, contiguous). With ``A_log`` and ``dt_bias`` (``[HV]``), g and beta are the raw
    gate projections a and b and the kernel forms the gates itself (one launch fewer per layer)."""
    B, _, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if HV % H:
        raise ValueError(f"value heads ({HV}) must be a multiple of q/k heads ({H})")
    if not state.is_contiguous() or state.dtype != torch.float32:
        raise ValueError("state must be a contiguous fp32 [B, HV, K, V] tensor")
    q, k, v = _heads(q, "q"), _heads(k, "k"), _heads(v, "v")
    g, beta = g.reshape(B, HV).contiguous(), beta.reshape(B, HV).contiguous()
    raw = A_log is not None
    if raw != (dt_bias is not None):
        raise ValueError("gdn_decode: A_log and dt_bias go together")
    if raw and (A_log.numel() != HV or dt_bias.numel() != HV):
        raise ValueError(f"gdn_decode: A_log and dt_bias must hold {HV} values (one per value head)")
    norm = norm_weight is not None
    if norm:
        gate = _heads(gate, "gate")
        if norm_weight.dtype != v.dtype:  # the kernel rounds w · x̂ to v's dtype, as the module does for same dtypes
            raise ValueError(f"norm_weight must have v's dtype {v.dtype}, got {norm_weight.dtype}")
    BK = max(16, next_pow2(K))
    if BV is None:
        BV = DECODE_NORM_BV if norm else DECODE_BV
        BV = min(BV, max(16, next_pow2(V)))
    if BV < 16 or BV & (BV - 1):
        raise ValueError(f"gdn_decode: BV must be a power of two ≥ 16, got {BV}")
    NV = triton.cdiv(V, BV)
    if num_warps is None:
        num_warps = 8 if BK * BV >= 128 * 128 else 4
    o = torch.empty(B, 1, HV, V, device=v.device, dtype=v.dtype) if out is None else out
    z = gate if norm else v
    scratch = zeroed_scratch(v.device, (B * HV, 2)) if norm and NV > 1 else state
    with launch_ctx(INTERPRET):
        _gdn_decode_kernel[(NV, B * HV)](
            q, k, v, g, beta, state, o, z, norm_weight if norm else state,
            A_log.contiguous() if raw else state, dt_bias.contiguous() if raw else state,
            float(K ** -0.5 if scale is None else scale), float(eps), scratch,
            q.stride(0), q.stride(2), k.stride(0), k.stride(2), v.stride(0), v.stride(2), g.stride(0),
            beta.stride(0), z.stride(0), z.stride(2), o.stride(0), o.stride(2),
            H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, L2=bool(use_qk_l2norm_in_kernel), NORM=norm, RAW_GATES=raw,
            NV=NV, BVF=max(16, next_pow2(V)), num_warps=num_warps,
        )
    return o

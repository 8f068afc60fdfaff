"""Triton int8-weight linear for a few rows (the drafter's lm_head: 15 rows against a 248k-row vocabulary).

Memory-bound: the weight is read once, as int8 (half of bf16's bytes), converted to the input dtype in registers
(exact: |q| ≤ 127) and multiplied on the tensor cores with fp32 sums; the row scale is applied once per output. Each
program owns ``BN`` output columns (weight rows) and a block of ``BM`` input rows (all of them for M ≤ 64) and walks
K in ``BK`` steps. H200, 15 rows × 248320 × 5120 (BENCHMARKS.md, 2026-12-02): 0.323 ms, 3.94 TB/s (cuBLAS bf16 0.621
ms; cuBLAS's fp8 ``_scaled_mm`` on the same number of bytes 0.434 ms, 2.9 TB/s).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils import is_interpret, launch_ctx, next_pow2

_INTERPRET = is_interpret()


@triton.jit
def _int8_linear_kernel(x, w, scale, out, M, N, K, sxm, swn, som,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32_DOT: tl.constexpr):
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    row_ok = rows < M
    col_ok = cols < N
    w_rows = w + cols.to(tl.int64)[:, None] * swn
    x_rows = x + rows.to(tl.int64)[:, None] * sxm
    acc = tl.full([BM, BN], 0.0, tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        xt = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0)
        if F32_DOT:  # (the interpreter's dot of bf16 tiles is wrong; bf16 products are exact in fp32)
            acc += tl.dot(xt.to(tl.float32), tl.trans(wt.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(xt, tl.trans(wt.to(xt.dtype)))
    s = tl.load(scale + cols, mask=col_ok, other=0.0)
    acc = acc * s[None, :]
    tl.store(out + rows.to(tl.int64)[:, None] * som + cols[None, :], acc.to(out.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


# Candidates timed by the autotuner on first use per shape (eager warm-up calls, before any graph capture); one
# config under the interpreter.
_CONFIGS = [triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=s)
            for bn, bk, w, s in ((64, 256, 4, 4), (128, 128, 4, 4), (128, 256, 4, 3), (128, 256, 8, 4),
                                 (256, 128, 8, 4), (64, 512, 4, 3))]
_int8_linear_autotuned = triton.autotune(configs=_CONFIGS[:1] if _INTERPRET else _CONFIGS,
                                         key=["N", "K", "BM"])(_int8_linear_kernel)


def int8_linear_triton(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` (bf16 or fp16) times ``q [N, K]`` int8 with ``scale [N]`` fp32 → ``[..., N]`` in x's dtype."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, N = x2.shape[0], q.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        bm = min(64, max(16, next_pow2(M)))  # tl.dot takes ≥ 16 rows
        with launch_ctx(_INTERPRET):
            _int8_linear_autotuned[lambda meta: (triton.cdiv(N, meta["BN"]), triton.cdiv(M, bm))](
                x2, q, scale, out, M, N, K, x2.stride(0), q.stride(0), out.stride(0), BM=bm, F32_DOT=_INTERPRET)
    return out.view(*x.shape[:-1], N)

"""Triton int8-weight linear for a few rows (the drafter's lm_head: 15 rows against a 248k-row vocabulary).

Memory-bound: the weight is read once, as int8 (half of bf16's bytes), converted to the input dtype in registers
(exact: |q| ≤ 127) and multiplied on the tensor cores with fp32 sums; the row scale is applied once per output. Each
program owns ``BN`` output columns (weight rows) and a block of ``BM`` input rows (all of them for M ≤ 64) and walks
its share of K in ``BK`` steps: all of K where the column tiles fill the SMs (an lm_head), else one of a few shares
whose fp32 partials are summed after (:func:`split_k`; the drafter's own layers). It reads the weight near the copy
bandwidth, where cuBLAS's fp8 path does not at so few rows (timings: BENCHMARKS.md, Kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import INTERPRET
from ..utils import launch_ctx, next_pow2


@triton.jit
def _int8_linear_kernel(x, w, scale, out, M, N, K, SPLIT, sxm, swn, som, sos,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32_DOT: tl.constexpr):
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    # split K: program k sums its share of whole BK tiles and writes a partial [BM, BN] at out + k · sos
    k_per = ((K + SPLIT - 1) // SPLIT + BK - 1) // BK * BK  # (tl.cdiv is a jit function: not in interpreted copies)
    k_lo = tl.program_id(2) * k_per
    k_hi = tl.minimum(k_lo + k_per, K)
    row_ok = rows < M
    col_ok = cols < N
    w_rows = w + cols.to(tl.int64)[:, None] * swn
    x_rows = x + rows.to(tl.int64)[:, None] * sxm
    acc = tl.full([BM, BN], 0.0, tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < k_hi
        xt = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0)
        if F32_DOT:  # (the interpreter's dot of bf16 tiles is wrong; bf16 products are exact in fp32)
            acc += tl.dot(xt.to(tl.float32), tl.trans(wt.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(xt, tl.trans(wt.to(xt.dtype)))
    s = tl.load(scale + cols, mask=col_ok, other=0.0)
    acc = acc * s[None, :]
    tl.store(out + tl.program_id(2).to(tl.int64) * sos + rows.to(tl.int64)[:, None] * som + cols[None, :],
             acc.to(out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# Candidates timed by the autotuner on first use per shape (eager warm-up calls, before any graph capture; every
# program writes its own outputs, so the timing runs leave nothing behind); one config under the interpreter.
_CONFIGS = [triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=s)
            for bn, bk, w, s in ((64, 256, 4, 4), (128, 128, 4, 4), (128, 256, 4, 3), (128, 256, 8, 4),
                                 (256, 128, 8, 4), (64, 512, 4, 3))]
_int8_linear_autotuned = triton.autotune(configs=_CONFIGS[:1] if INTERPRET else _CONFIGS,
                                         key=["N", "K", "SPLIT", "BM"])(_int8_linear_kernel)

_SMS: dict = {}


def split_k(device, M: int, N: int, K: int) -> int:
    """How many K shares a product takes: 1 where the column tiles (128 wide) fill the GPU's SMs — a vocabulary of
    248k columns gives 1940 programs — else enough shares for about two programs per SM, each at least 512 deep.
    A drafter layer's 16-32 rows × 1024-17408 columns would otherwise run 8-136 programs on an H200's 132 SMs."""
    if device.type != "cuda":
        return 1
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    programs = triton.cdiv(N, 128) * triton.cdiv(M, 64)
    if programs >= _SMS[device]:
        return 1
    return max(1, min(triton.cdiv(2 * _SMS[device], programs), K // 512))


def int8_linear_triton(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, split: int | None = None
                       ) -> torch.Tensor:
    """``x [..., K]`` (bf16 or fp16) times ``q [N, K]`` int8 with ``scale [N]`` fp32 → ``[..., N]`` in x's dtype.
    ``split`` (default :func:`split_k`): K shares, each program writing an fp32 partial, summed after."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, N = x2.shape[0], q.shape[0]
    split = split_k(x.device, M, N, K) if split is None else split
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        bm = min(64, max(16, next_pow2(M)))  # tl.dot takes ≥ 16 rows
        partial = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
        with launch_ctx(INTERPRET):
            _int8_linear_autotuned[lambda meta: (triton.cdiv(N, meta["BN"]), triton.cdiv(M, bm), split)](
                x2, q, scale, partial, M, N, K, split, x2.stride(0), q.stride(0), partial.stride(-2),
                partial.stride(0) if split > 1 else 0, BM=bm, F32_DOT=INTERPRET)
        if split > 1:
            out.copy_(partial.sum(0))
    return out.view(*x.shape[:-1], N)

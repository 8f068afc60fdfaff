"""The drafter's lm_head and pool top-k at a target's shape, side by side (CUDA events, median of runs).

    python scripts/bench_draft_head.py --rows 15 --hidden 5120 --vocab 248320 --pool 512

A DFlash draft reads the whole target lm_head for its block's rows (2.54 GB at Qwen3.6-27B shape: ≈ 0.59 ms at
4.3 TB/s, the largest piece of a draft). Timed in one run: ``F.linear`` with the bf16 weight; the int8 copy through
``weaver_kernels.int8_linear`` (:class:`~modeling_weaver.decoding.drafting.DraftHead` with ``int8``: half the bytes, the
activations in bf16); the pool's ``torch.topk`` over the draft logits in fp32 and in bf16. Also printed: how far the
int8 logits are from the bf16 ones (relative RMS, top-1 agreement, overlap of the top ``--pool``) on random weights,
whose flat logits make the overlap a pessimistic figure.
"""
import argparse

import torch
import torch.nn.functional as F

from modeling_weaver.decoding.drafting import DraftHead
from modeling_weaver.cli import positive_int


def median_ms(fn, runs: int, reps: int) -> float:
    for _ in range(3):  # (the first call autotunes the int8 kernel)
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[runs // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=positive_int, default=15, help="block rows projected (block size − 1)")
    parser.add_argument("--hidden", type=positive_int, default=5120)
    parser.add_argument("--vocab", type=positive_int, default=248320)
    parser.add_argument("--pool", type=positive_int, default=512)
    parser.add_argument("--runs", type=positive_int, default=15)
    parser.add_argument("--reps", type=positive_int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, device="cuda") * args.hidden ** -0.5).bfloat16()
    hidden = torch.randn(args.rows, args.hidden, device="cuda").bfloat16()
    int8 = DraftHead(weight, None, torch.bfloat16, int8=True)

    rows = []
    for name, fn, size in (("bf16", lambda: F.linear(hidden, weight), weight.numel() * 2),
                           ("int8 (Triton)", lambda: int8(hidden), weight.numel() + 4 * args.vocab)):
        ms = median_ms(fn, args.runs, args.reps)
        rows.append((f"lm_head {name}, {args.rows} rows", ms, size / ms / 1e9))
    logits = F.linear(hidden, weight)
    for dtype in (torch.float32, torch.bfloat16):
        block = logits.to(dtype)
        rows.append((f"torch.topk {args.pool} over [{args.rows}, {args.vocab}] {dtype}",
                     median_ms(lambda: block.topk(args.pool, dim=-1), args.runs, args.reps), None))
    print(f"\n## draft head, GPU ms (median of {args.runs} × {args.reps} calls; "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__})")
    print("| op | ms | TB/s |\n|---|---|---|")
    for name, ms, rate in rows:
        print(f"| {name} | {ms:.4f} | {'' if rate is None else f'{rate:.2f}'} |")

    logits = logits.float()
    approx = int8(hidden).float()
    rel = ((approx - logits).pow(2).mean() / logits.pow(2).mean()).sqrt().item()
    top1 = (approx.argmax(-1) == logits.argmax(-1)).float().mean().item()
    ref, got = logits.topk(args.pool, -1).indices, approx.topk(args.pool, -1).indices
    overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ref, got)) / ref.numel()
    print(f"int8 against bf16 logits (random weights): relative RMS {rel:.4f}, top-1 agreement {top1:.3f}, "
          f"top-{args.pool} overlap {overlap:.3f}")


if __name__ == "__main__":
    with torch.no_grad():
        main()

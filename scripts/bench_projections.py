"""Would merging the target's projections that share an input speed up a decode step? Measured before building it.

    PYTHONPATH=kernels python scripts/bench_projections.py --shape qwen3.6-27b --rows 1 65

Each decoder layer of a Qwen3.5/3.6 hybrid runs several GEMMs on the same input: a Gated DeltaNet layer
``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` (the last two tiny: hidden → value heads), an attention
layer ``q_proj``, ``k_proj``, ``v_proj``, every MLP ``gate_proj`` and ``up_proj``. At batch 1 these GEMMs read their
weights once per step (memory-bound), so one GEMM over the concatenated weight reads the same bytes in fewer, larger
launches. This script times, for every layer of the target shape (random bf16 weights, shapes from the config on the
meta device), the shared-input GEMMs run separately and as one GEMM on the concatenated weight, at ``--rows`` tree
sizes (1 = an AR step, 65 = a budget-64 tree), each variant one CUDA graph over all layers (weights well past the L2),
median of ``--reps`` replays after warm-up (``bench_kernels.graph_time_us``). The separate variant multiplies row
blocks of the same storage that the merged one reads whole, so only the launch structure differs.

Prints, per rows: ms per step for each variant, the bytes read and their rate, and the difference (what merging
would take off each step). The output and down projections are left out (nothing to merge them with).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

GROUPS = (("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), ("q_proj", "k_proj", "v_proj"),
          ("gate_proj", "up_proj"))


def shared_input_groups(model) -> list[list[torch.Size]]:
    """Per layer and group, the ``[out, in]`` weight shapes of the linears that read one input."""
    groups = []
    for layer in model.model.layers if hasattr(model.model, "layers") else model.model.language_model.layers:
        for module in layer.modules():
            for names in GROUPS:
                if all(isinstance(getattr(module, n, None), torch.nn.Linear) for n in names):
                    groups.append([getattr(module, n).weight.shape for n in names])
    return groups


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3.6-27b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 65])
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    from bench_kernels import graph_time_us  # this folder (the weaver_kernels package on the path, as there)
    from transformers import AutoModelForCausalLM

    from modeling_weaver.export import HUB_SPECS

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (the question is about GPU launches)")
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(HUB_SPECS[args.shape].target(), dtype=torch.bfloat16)
    groups = shared_input_groups(meta)
    del meta
    hidden = groups[0][0][1]
    merged = [torch.randn(sum(s[0] for s in g), hidden, device="cuda", dtype=torch.bfloat16) for g in groups]
    split = [w.split([s[0] for s in g]) for g, w in zip(groups, merged)]  # row blocks: the separate GEMMs
    nbytes = sum(w.numel() * w.element_size() for w in merged)
    print(f"{args.shape}: {len(groups)} shared-input groups, {sum(len(g) for g in groups)} GEMMs → {len(groups)}, "
          f"{nbytes / 1e9:.2f} GB of weights")
    for rows in args.rows:
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)

        def separate():
            for ws in split:
                for w in ws:
                    F.linear(x, w)

        def together():
            for w in merged:
                F.linear(x, w)

        t_sep, t_one = (graph_time_us([f], args.reps) / 1e3 for f in (separate, together))  # ms
        print(f"rows {rows}: separate {t_sep:.3f} ms ({nbytes / t_sep / 1e9:.2f} TB/s), merged {t_one:.3f} ms "
              f"({nbytes / t_one / 1e9:.2f} TB/s) → {t_sep - t_one:+.3f} ms per step")

if __name__ == "__main__":
    main()

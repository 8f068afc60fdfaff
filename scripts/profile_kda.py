"""Per-launch device time of the tree KDA forms and the tree GDN forms at Kimi Linear's KDA shape (torch profiler).

Where ``bench_kda.py`` times whole verify + commit steps under CUDA graphs, this says which launch the time is in:
for each tree kind at T nodes (32 heads, K = V = 128, bf16 inputs, raw gates formed in the kernels; ``bench_kda``'s
inputs and trees), each form's verify + commit is run eagerly ``--reps`` times after a warm-up under the torch
profiler, and each kernel's mean device µs per step is printed, with the sum; then the registers and spills of the
compiled KDA kernels. Profiler times are per launch without the gaps between launches (a graph replay's total is
higher).

    PYTHONPATH=$PWD:$PWD/kernels python scripts/profile_kda.py [--kinds best_first deep15] [--T 64] [--reps 30]
        [--strip CONFIG ...]     # the strip form at bench_kda's --strip configs too
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kda as bk  # noqa: E402 (this folder: inputs, trees, --strip configs)
from weaver_kernels.gdn_tree.chunk import gdn_tree_commit_triton, gdn_tree_verify_triton  # noqa: E402
from weaver_kernels.kda_tree import commit, fused, neumann, strip  # noqa: E402
from weaver_kernels.testing import ancestor_mask, path_to  # noqa: E402


def per_launch(step, reps: int) -> dict[str, float]:
    """Mean device µs per call of ``step`` by kernel name."""
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    total = collections.defaultdict(float)
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time
    return {name: t / reps for name, t in total.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", nargs="+", default=["best_first", "deep15"], choices=("best_first", "deep15", "chain"))
    ap.add_argument("--T", type=int, default=64)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--strip", nargs="+", default=[], metavar="CONFIG", help="bench_kda's --strip configs")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    dev = "cuda"
    forms = {"fused": fused.kda_tree_verify_triton, "neumann": neumann.kda_tree_verify_neumann}
    if args.T <= strip.MAX_NODES:
        forms["strip"] = strip.kda_tree_verify_strip
        forms.update({f"strip {c}": functools.partial(strip.kda_tree_verify_strip, **bk.strip_config(c))
                      for c in args.strip})
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | T = {args.T} | µs per step by launch")
    for kind in args.kinds:
        parents, _, leaf = bk.make_tree(args.T, kind, seed=args.T + {"chain": 7, "deep15": 3}.get(kind, 0))
        mask = ancestor_mask(parents, dev)
        path = torch.tensor(path_to(parents, leaf), device=dev)
        y = bk.make_layer(args.T, 32, 128, 0, dev, True)
        print(kind)
        steps = {}
        for name, verify in forms.items():
            def step(verify=verify):
                _, u, gamma = verify(y["q"], y["k"], y["v"], y["kg"], y["kb"], y["S0"], mask,
                                     use_qk_l2norm_in_kernel=True, **y["kraw"])
                commit.kda_tree_commit_triton(y["S"], y["k"], u, gamma, path, True)
            steps[f"KDA {name}"] = step
        for impl in (None, "fused"):
            def gstep(impl=impl):
                _, u, gamma = gdn_tree_verify_triton(y["q"], y["k"], y["v"], y["gk_g"], y["gk_b"], y["gS0"], mask,
                                                     use_qk_l2norm_in_kernel=True, impl=impl, **y["graw"])
                gdn_tree_commit_triton(y["gS"], y["k"], u, gamma, path, use_qk_l2norm_in_kernel=True)
            steps[f"GDN {impl or 'default'}"] = gstep
        for name, step in steps.items():
            t = per_launch(step, args.reps)
            print(f"  {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in t.items()) + f" | sum {sum(t.values()):.1f}")
    print("registers / spills of the compiled KDA kernels:")
    for fn in (fused._kda_gamma_kernel, fused._kda_pairs_kernel, fused._kda_tree_verify_kernel,
               neumann._kda_coef_kernel, neumann._kda_neumann_solve_kernel, strip._kda_strip_kernel,
               strip._kda_strip_solve_kernel, commit._kda_tree_commit_kernel):
        for caches in fn.device_caches.values():
            for ck in caches[0].values():
                print(f"  {fn.__name__}: {ck.n_regs} registers, {ck.n_spills} spills, {ck.metadata.num_warps} warps")


if __name__ == "__main__":
    main()

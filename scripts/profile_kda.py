"""Per-launch device time of the tree KDA forms and the tree GDN forms at Kimi Linear's KDA shape (torch profiler).

Where ``bench_kda.py`` times whole verify + commit steps under CUDA graphs, this says which launch the time is in:
for each tree kind at T nodes (32 heads, K = V = 128, bf16 inputs, raw gates formed in the kernels; ``bench_kda``'s
inputs and trees), each form's verify + commit is run eagerly ``--reps`` times after a warm-up under the torch
profiler, and each kernel's mean device µs per step is printed, with the sum; then the registers and spills of the
compiled KDA kernels. Profiler times are per launch without the gaps between launches (a graph replay's total is
higher).

``--stages`` says where inside the strips launch (the strip form's first, its longest) the time goes: the strip
module's source with an SM-clock stamp (``%clock64``, tied to a stage's result so that it cannot run before it)
after each stage of ``_kda_strip_kernel``, written to a temporary file and imported; its outputs are checked equal to
the unstamped form's, then per stage the median cycles over programs and the stages of the slowest program (a
launch waits for it). Each stamp reduces its tensor (a barrier), so the stamped launch is slower than the plain one.

    PYTHONPATH=$PWD:$PWD/kernels python scripts/profile_kda.py [--kinds best_first deep15] [--T 64] [--reps 30]
        [--strip CONFIG ...]     # the strip form at bench_kda's --strip configs too
        [--stages]               # only the strips launch's stages
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.util
import inspect
import os
import sys
import tempfile

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


HEADS = 32  # Kimi Linear's KDA heads (of 128 channels)

# where the stamps go in _kda_strip_kernel: (a line's start, the tensor stamped, the stage that ends there); the stamp
# follows the line, or precedes it where the tensor is marked "<"
STAGES = (
    ("if b * BT < T:", "tl.zeros([16, 16], tl.float32) + b", "start"),
    ("G_all = _mask_dot(M_all, g_all", "<g_all", "loads, gates"),
    ("G_r = ", "G_r", "Γ (mask dots)"),
    ("kT = tl.trans(", "kT", "references, exps"),
    ("qk = tl.dot(", "qk", "pair dots"),
    ("# the mask after the dots", "<kk", "wide channels"),
    ("A = tl.where(", "A", "l2 norms, A"),
    ("P = block_inverse(", "<A_d", "diagonal block"),
    ("N = ", "<P", "inverse"),
    ("# mats [2, B, HV, TP, TP]", "<Vd", "N, W, Vd"),
    ("tl.store(row + 2 * BK + o_vf", "Vd", "stores"),
)
STAMP = '''
@triton.jit
def _stamp(x):  # the SM clock once x is formed: the asm reads it, the reduction ends every thread's part
    t = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1)
    return tl.max(tl.max(t, 1), 0)

'''


def stamped_strip(folder: str):
    """The strip module with a clock stamp after each of :data:`STAGES`, stored ``[programs, 16]`` (int64) into
    ``module.STAMPS[0]``, which the caller sets before a launch."""
    lines, out, i = inspect.getsource(strip).split("\n"), [], 0
    for line in lines:
        text = line.strip()
        if i < len(STAGES) and text.startswith(STAGES[i][0]):
            before = STAGES[i][1].startswith("<")
            stamp = f"        st{i} = _stamp({STAGES[i][1].lstrip('<')})"
            out += [stamp, line] if before else [line, stamp]
            i += 1
            if i == len(STAGES):
                out.append("        at_ = stamps + (tl.program_id(1) * tl.num_programs(0) + b) * 16")
                out += [f"        tl.store(at_ + {j}, st{j})" for j in range(len(STAGES))]
        else:
            out.append(line)
    if i < len(STAGES):
        raise RuntimeError(f"strip.py changed: no line starts with {STAGES[i][0]!r}; update STAGES")
    src = "\n".join(out).replace("\n@triton.jit\ndef _mask_dot", STAMP + "\n@triton.jit\ndef _mask_dot", 1)
    for old, new in (("dt_bias, gamma, mats, rows, T,", "dt_bias, gamma, mats, rows, stamps, T,"),
                     ("dt, gamma, mats, rows, T, *sq", "dt, gamma, mats, rows, STAMPS[0], T, *sq")):
        if src.count(old) != 1:
            raise RuntimeError(f"strip.py changed: {old!r} not found once")
        src = src.replace(old, new)
    path = os.path.join(folder, "_strip_stamped.py")
    with open(path, "w") as f:
        f.write(src + "\n\nSTAMPS = [None]\n")
    spec = importlib.util.spec_from_file_location("weaver_kernels.kda_tree._strip_stamped", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def inputs(T: int, kind: str, dev: str):
    """bench_kda's tree of ``kind`` (ancestor mask, accepted path) and one layer's inputs at Kimi Linear's KDA shape."""
    parents, _, leaf = bk.make_tree(T, kind)
    path = torch.tensor(path_to(parents, leaf), device=dev)
    return ancestor_mask(parents, dev), path, bk.make_layer(T, HEADS, 128, 0, dev, True)


def kda_verify(form, y, mask):
    """One KDA verify ``form`` on :func:`inputs`' layer ``y``, raw gates formed in the kernel."""
    return form(y["q"], y["k"], y["v"], y["kg"], y["kb"], y["S0"], mask, use_qk_l2norm_in_kernel=True, **y["kraw"])


def stages(mod, kind: str, T: int, reps: int, dev: str):
    """Per-stage cycles of the strips launch of ``mod`` (:func:`stamped_strip`) on one tree of ``kind`` (bench_kda's
    inputs)."""
    mask, _, y = inputs(T, kind, dev)
    mod.STAMPS[0] = torch.zeros(max(16, T) // 16 * HEADS, 16, dtype=torch.int64, device=dev)  # programs × stamps
    same = all(torch.equal(a, b) for a, b in zip(kda_verify(strip.kda_tree_verify_strip, y, mask),
                                                  kda_verify(mod.kda_tree_verify_strip, y, mask)))
    runs = []
    for r in range(reps + 5):
        kda_verify(mod.kda_tree_verify_strip, y, mask)
        if r >= 5:
            runs.append(mod.STAMPS[0][:, :len(STAGES)].cpu())
    st = torch.stack(runs).double()  # [reps, programs, stages]
    d, total = st.diff(dim=-1), st[..., -1] - st[..., 0]
    slow = d.gather(1, total.argmax(1)[:, None, None].expand(-1, 1, d.shape[-1]))[:, 0]  # [reps, stages - 1]
    print(f"{kind}: outputs equal to the unstamped form's: {same}; cycles per program: median "
          f"{total.median():.0f}, the slowest program's median {total.max(1).values.median():.0f}")
    for j, (_, _, name) in enumerate(STAGES[1:]):
        print(f"  {name:18s} median {d[..., j].median():7.0f}   slowest program {slow[:, j].median():7.0f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", nargs="+", default=["best_first", "deep15"], choices=("best_first", "deep15", "chain"))
    ap.add_argument("--T", type=int, default=64)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--strip", nargs="+", default=[], metavar="CONFIG", help="bench_kda's --strip configs")
    ap.add_argument("--stages", action="store_true", help="only the strips launch's stages, in SM cycles")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    dev = "cuda"
    if args.stages:
        if args.T > strip.MAX_NODES:
            ap.error(f"--stages: the strip form takes at most {strip.MAX_NODES} nodes")
        print(f"{torch.cuda.get_device_name()} | T = {args.T} | strips launch, SM cycles by stage")
        with tempfile.TemporaryDirectory() as tmp:
            mod = stamped_strip(tmp)
            for kind in args.kinds:
                stages(mod, kind, args.T, args.reps, dev)
        return
    forms = {"fused": fused.kda_tree_verify_triton, "neumann": neumann.kda_tree_verify_neumann}
    if args.T <= strip.MAX_NODES:
        forms["strip"] = strip.kda_tree_verify_strip
        forms.update({f"strip {c}": functools.partial(strip.kda_tree_verify_strip, **bk.strip_config(c))
                      for c in args.strip})
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | T = {args.T} | µs per step by launch")
    for kind in args.kinds:
        mask, path, y = inputs(args.T, kind, dev)
        print(kind)
        steps = {}
        for name, verify in forms.items():
            def step(verify=verify):
                _, u, gamma = kda_verify(verify, y, mask)
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

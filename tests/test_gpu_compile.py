"""The tree KDA kernels compiled for a CUDA target on the CPU: no device, Triton's CUDA backend and its ptxas only.

The interpreter tests run the kernels' Python, not Triton's compiler: a kernel that the compiler rejects (an MLIR pass
failing, ptxas refusing the PTX) passes them and fails on the GPU only. Here each launch of the real wrappers
(``kda_tree_verify_triton``, ``kda_tree_verify_neumann``, ``kda_tree_verify_strip``, ``kda_tree_commit_triton``) at
Kimi Linear's shape is compiled instead of run: a stand-in driver names the target (the arguments' specializations
are the wrapper's own), and Triton's compile goes through every pass down to a cubin from ptxas. Skipped where the
CUDA backend or ptxas is missing, or where the kernels were imported under ``TRITON_INTERPRET=1``. Nothing is cached
in the repository (a temporary Triton cache per module).
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import subprocess
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from weaver_kernels.testing import ancestor_mask, random_parents

TARGET_ARCH = 90  # H100


def _offline_cuda_reason() -> str | None:
    """Why kernels cannot be compiled for CUDA here, or None."""
    try:
        import triton
        from triton.backends import backends
    except Exception as e:  # noqa: BLE001
        return f"triton not importable ({e!r})"
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "TRITON_INTERPRET=1: the kernels are interpreted, not compiled"
    if "nvidia" not in backends:
        return f"triton {triton.__version__} has no CUDA backend"
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(TARGET_ARCH).path
        subprocess.run([ptxas, "--version"], check=True, capture_output=True, timeout=60)
    except Exception as e:  # noqa: BLE001
        return f"no working ptxas for sm_{TARGET_ARCH} in triton {triton.__version__} ({e!r})"
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    if not (hasattr(driver, "set_active") and hasattr(driver, "_active") and hasattr(JITFunction, "create_binder")):
        return f"triton {triton.__version__}: the offline driver stand-in does not fit its runtime"
    return None


class _TargetOnlyDriver:
    """What a compile-only launch asks of the active driver: a device, a stream and the target."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def is_active(self):
        return True


@contextlib.contextmanager
def compile_only(kernels, arch: int, compiled: list):
    """Within the block every launch of ``kernels`` compiles for ``cuda:arch`` (a warm-up: nothing runs) and its
    compiled kernel is appended to ``compiled``. The kernels' own caches are set aside and put back after."""
    from triton.runtime.driver import driver

    old_driver, old_caches = driver._active, {k: k.device_caches for k in kernels}
    driver.set_active(_TargetOnlyDriver(arch))
    for k in kernels:
        k.device_caches = defaultdict(k.create_binder)

        def run(*args, grid, warmup, _k=k, **kwargs):
            compiled.append(type(_k).run(_k, *args, grid=grid, warmup=True, **kwargs))
            return compiled[-1]

        k.run = run
    try:
        yield
    finally:
        driver._active = old_driver
        for k in kernels:
            del k.run
            k.device_caches = old_caches[k]


@pytest.fixture(scope="module")
def kda_kernels(tmp_path_factory):
    reason = _offline_cuda_reason()
    if reason:
        pytest.skip(reason)
    from weaver_kernels.kda_tree import commit, fused, neumann, strip

    if fused.INTERPRET or commit.INTERPRET or neumann.INTERPRET or strip.INTERPRET:
        pytest.skip("the kda_tree modules were imported under TRITON_INTERPRET=1")
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton_cache")))  # a real compile, kept out of the repo
    yield SimpleNamespace(fused=fused, neumann=neumann, strip=strip, commit=commit)
    mp.undo()


@pytest.mark.parametrize("form", ["fused", "neumann", "neumann_ieee", "strip"])
@pytest.mark.parametrize("T, raw", [(64, True), (128, False)], ids=["T64-raw_gates", "T128-formed_gates"])
def test_kda_tree_kernels_compile_for_sm90(kda_kernels, T, raw, form):
    """Kimi Linear's KDA shape (32 heads, K = V = 128, bf16 inputs, l2-normed q/k), a T-node tree, gates raw (with
    A_log and dt_bias) or formed: each launch of the verify (fused, Neumann form with its solve dots in tf32x3 or
    IEEE fp32, or strip form up to its 64 nodes) and the commit compiles to an sm_90 cubin."""
    x = kda_kernels
    if form == "strip" and T > x.strip.MAX_NODES:
        pytest.skip(f"the strip form takes at most {x.strip.MAX_NODES} nodes")
    H = HV = 32
    K = V = 128
    bf = torch.bfloat16
    gen = torch.Generator().manual_seed(T)
    q, k = (torch.randn(1, T, H, K, generator=gen).to(bf) for _ in range(2))
    v = torch.randn(1, T, HV, V, generator=gen).to(bf)
    g = torch.randn(1, T, HV, K, generator=gen).to(bf if raw else torch.float32)
    beta = torch.randn(1, T, HV, generator=gen).to(bf if raw else torch.float32)
    S0 = torch.zeros(1, HV, K, V)
    mask = ancestor_mask(random_parents(T, random.Random(T)))
    gates = dict(A_log=torch.zeros(HV), dt_bias=torch.zeros(HV * K)) if raw else {}
    if form == "fused":
        verify = x.fused.kda_tree_verify_triton
        kernels = [x.fused._kda_gamma_kernel, x.fused._kda_pairs_kernel, x.fused._kda_tree_verify_kernel]
    elif form == "strip":
        verify = x.strip.kda_tree_verify_strip
        kernels = [x.strip._kda_strip_kernel, x.strip._kda_strip_solve_kernel]
    else:
        verify = functools.partial(x.neumann.kda_tree_verify_neumann,
                                   precision="ieee" if form.endswith("ieee") else "tf32x3")
        kernels = [x.fused._kda_gamma_kernel, x.neumann._kda_coef_kernel, x.neumann._kda_neumann_solve_kernel]
    kernels.append(x.commit._kda_tree_commit_kernel)
    compiled: list = []
    with compile_only(kernels, TARGET_ARCH, compiled):
        _, u, gamma = verify(q, k, v, g, beta, S0, mask, use_qk_l2norm_in_kernel=True, **gates)
        x.commit.kda_tree_commit_triton(S0, k, u, gamma, torch.arange(8), use_qk_l2norm_in_kernel=True)
    assert [c.name for c in compiled] == [kk.__name__ for kk in kernels]
    for c in compiled:
        assert c.metadata.target.arch == TARGET_ARCH and len(c.asm["cubin"]) > 0, c.name
    if form == "neumann" and T == 64:  # its defaults were chosen so: IEEE FMA dots spilled ~5 KB here
        solve = compiled[2]
        assert spill_bytes(solve) == 0, f"{solve.name} spills at T = {T}"


def test_profile_kda_stage_stamps_compile_for_sm90(kda_kernels, tmp_path):
    """``scripts/profile_kda.py --stages``: its stamps still find their lines in strip.py's source, and the stamped
    strips kernel compiles to sm_90 with one clock read per stage (Kimi's shape, 64 nodes, raw gates)."""
    import importlib
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    try:
        profile_kda = importlib.import_module("profile_kda")
    finally:
        sys.path.pop(0)
    mod = profile_kda.stamped_strip(str(tmp_path))
    T, H, K = 64, 32, 128
    bf = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(1, T, H, K, generator=gen).to(bf) for _ in range(4))
    beta = torch.randn(1, T, H, generator=gen).to(bf)
    mod.STAMPS[0] = torch.zeros(T // 16 * H, 16, dtype=torch.int64)
    compiled: list = []
    with compile_only([mod._kda_strip_kernel, mod._kda_strip_solve_kernel], TARGET_ARCH, compiled):
        mask = ancestor_mask(random_parents(T, random.Random(0)))
        mod.kda_tree_verify_strip(q, k, v, g, beta, torch.zeros(1, H, K, K), mask, use_qk_l2norm_in_kernel=True,
                                  A_log=torch.zeros(H), dt_bias=torch.zeros(H * K))
    ptx = compiled[0].asm["ptx"]
    assert compiled[0].name == "_kda_strip_kernel" and ptx.count("%clock64") >= len(profile_kda.STAGES)


def spill_bytes(compiled) -> int:
    """Bytes of spill stores ptxas reports for a compiled kernel's PTX (``ptxas -v`` at its target)."""
    import re
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    arch = compiled.metadata.target.arch
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        out = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a", ptx, "-o", os.devnull],
                             capture_output=True, text=True, timeout=300, check=True)
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", out.stderr))

"""Small helpers shared by the kernel modules (no Triton import here: CPU-only installs never need Triton)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import types


def next_pow2(n: int) -> int:
    """Smallest power of two ≥ max(n, 1)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def is_interpret() -> bool:
    """True when Triton's CPU interpreter is switched on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@contextlib.contextmanager
def interpret_env(on: bool = True):
    """Set ``TRITON_INTERPRET`` for the duration of the block, then restore the previous value."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


# The most nodes a Weaver round's fused node attention takes (weaver_tree/attention.py keeps a round's rows in one tile).
NODE_ATTENTION_MAX_ROWS = 16

_SCRATCH: dict = {}


def zeroed_scratch(device, shape: tuple, dtype=None):
    """A zeroed scratch buffer kept per device, shape and dtype (fp32 by default) for kernels whose programs meet
    through atomics and leave it zeroed again. Launches on one stream only: two in flight at once would share it.
    Inside a CUDA graph capture without one yet, a fresh buffer (zeroed in the graph) rather than one the graph's
    pool owns."""
    import torch

    dtype = dtype or torch.float32
    key = (device, tuple(shape), dtype)
    if key not in _SCRATCH:
        if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return torch.zeros(shape, device=device, dtype=dtype)
        _SCRATCH[key] = torch.zeros(shape, device=device, dtype=dtype)
    return _SCRATCH[key]


def launch_ctx(interpret: bool):
    """Context for a kernel launch: under the interpreter Triton also reads ``TRITON_INTERPRET`` at call time."""
    return interpret_env(True) if interpret else contextlib.nullcontext()


def load_interpreted(module_name: str) -> types.ModuleType:
    """A fresh, private copy of a kernel module whose ``@triton.jit`` kernels run on Triton's CPU interpreter.

    Triton decides at *decoration* time (``@triton.jit``) whether a kernel is compiled or interpreted, from
    ``TRITON_INTERPRET``. Tests that share one process with code that already imported the kernels in compiled mode
    (any CPU-only pytest run) therefore cannot flip the variable afterwards. This executes the module again under
    ``TRITON_INTERPRET=1``, together with every kernel module of the package it imports (those that import Triton:
    the shared helpers of :mod:`.triton_utils`, another folder's launchers), so the copy calls interpreted kernels
    and helpers only. Modules without Triton (references, ``utils``) are shared, and its autotuners are collapsed to
    one config (each module checks :func:`is_interpret` when it is executed).

    The copy is imported under a private alias of the package (``_interpreted_<package>``: stub packages with the
    real folders as their path, the shared modules entered under the alias too), so the import binds its submodules
    on the stubs only: the real modules, their packages' attributes and ``sys.modules`` are left as they were (the
    alias entries are removed again), and no package ``__init__`` runs twice (ops register once).

    Triton is imported here first, outside interpreter mode, so that loading an interpreted copy never turns the
    process's Triton library into interpreted functions (which would break compiled kernels and torch.compile later
    in the same process).
    """
    import sys

    import triton

    importlib.import_module(module_name)  # the compiled import names every kernel module the copy needs
    top = module_name.split(".")[0]
    alias = f"_interpreted_{top}"  # (emptied again below: one name serves every copy)

    def kernel_module(name: str, mod) -> bool:
        return name == module_name or (not hasattr(mod, "__path__") and getattr(mod, "triton", None) is triton)

    try:
        for name, mod in list(sys.modules.items()):
            if name != top and not name.startswith(top + "."):
                continue
            renamed = alias + name[len(top):]
            if hasattr(mod, "__path__"):  # a package: a stub over the same folder (its __init__ not run again)
                stub = types.ModuleType(renamed)
                stub.__path__, stub.__package__ = list(mod.__path__), renamed
                sys.modules[renamed] = stub
            elif not kernel_module(name, mod):
                sys.modules[renamed] = mod  # shared as it is: no Triton in it
        with interpret_env(True):
            return importlib.import_module(alias + module_name[len(top):])
    finally:
        for name in [n for n in sys.modules if n == alias or n.startswith(alias + ".")]:
            del sys.modules[name]

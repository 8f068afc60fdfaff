"""Other weight forms for a model's linears at inference: prepacked oneDNN weights on a CPU, int8 weights for a
drafter on a GPU.

**CPU: prepacked oneDNN weights** — the same models, 1.5-4× faster GEMMs on a CPU.

PyTorch's CPU ``F.linear`` hands each call to MKL, which re-packs the weight every time; at the row counts of decoding
(1 token, or a tree of 9-65 nodes) that packing is most of the work. :func:`pack_cpu_linears` packs every
``nn.Linear`` weight of the given models once into oneDNN's blocked layout and routes the module's calls through it
(timings: BENCHMARKS.md, the CPU demo). It is an inference switch of the models themselves, so every caller sees
the same linears — transformers' ``generate``, our AR path and the speculative loop alike — and their greedy outputs
stay comparable token for token. The cost is one packed copy of each weight (+ the model's linear weights in memory).
:func:`packed_cpu_linears` is the scoped form the speculative loop uses by default on CPU
(``StepOptions.packed_linears``): packed calls inside one generation only, the copies kept for the next.

A packed module falls back to ``F.linear`` where the packed form does not apply: a non-CPU input, another dtype, or
autograd (a weight or input that requires grad under grad mode). A weight changed in place or replaced is re-packed
at its next call. :func:`unpack_cpu_linears` restores the modules.

**int8 weights for a drafter** — :func:`int8_linears` routes every ``nn.Linear`` call of at most ``max_rows`` rows
through an int8 copy of the weight (one scale per output row, ``weaver_kernels.int8_linear``: on CUDA one Triton
launch reading each weight byte once, half of bf16's bytes; on a CPU with torch's int8 GEMM,
``weaver_kernels.cpu_int8_linear`` — fbgemm's, a quarter of fp32's bytes, each row's activations rounded too;
elsewhere the torch reference, which dequantises on every call). Meant for drafters, whose outputs only shape
proposal trees: a speculative step's drafting is a few rows through the drafter's whole weights, memory-bound.
Calls with more rows (a prompt's context) and autograd use the original weight. The copy is made once: after
changing the weights, :func:`remove_int8_linears` and apply it again. Both drop the models' cached fixed-shape steps
(CUDA graphs and compiled steps traced through the old forward).
"""

from __future__ import annotations

import contextlib
import os
import weakref

import torch
import torch.nn.functional as F
import weaver_kernels

_PACKED = "_weaver_packed_weight"  # the module attribute holding [packed weight, weight version, weight pointer]
_INT8 = "_weaver_int8_weight"  # the module attribute holding (int8 weight, row scales)


def _available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _packable_dtypes() -> tuple[torch.dtype, ...]:
    """fp32 always; bf16 only where oneDNN has bf16 kernels for this CPU (else its reorder refuses the weight)."""
    try:
        bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        bf16 = False
    return (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)


def _available_memory() -> int | None:
    """Bytes of host memory available now (None where the OS does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _pack(weight: torch.Tensor) -> list:
    return [torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None), weight._version, weight.data_ptr()]


def _packed_forward(module: torch.nn.Linear, state: list):
    def forward(x: torch.Tensor) -> torch.Tensor:
        w = module.weight
        if (x.device.type != "cpu" or w.device.type != "cpu" or x.dtype != w.dtype
                or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))):
            return F.linear(x, w, module.bias)
        if state[1] != w._version or state[2] != w.data_ptr():  # changed in place, or a new weight
            state[:] = _pack(w)
        return torch.ops.mkldnn._linear_pointwise(x, state[0], module.bias, "none", [], "")

    return forward


def _plain_linears(models, dtypes=(torch.float32, torch.bfloat16, torch.float16)):
    """Every ``nn.Linear`` (exactly that class, without a patched forward) of ``models`` whose weight is a plain
    tensor of one of ``dtypes``."""
    for model in models:
        for module in model.modules():
            w = getattr(module, "weight", None)
            if (type(module) is torch.nn.Linear and "forward" not in module.__dict__ and type(w.data) is torch.Tensor
                    and w.dtype in dtypes):
                yield module


def _restore(models, attr: str) -> int:
    count = 0
    for model in models:
        for module in model.modules():
            if hasattr(module, attr):
                delattr(module, attr)
                del module.forward
                count += 1
    return count


def _cpu_linears(models) -> list[torch.nn.Linear]:
    if not _available():
        return []
    return [m for m in _plain_linears(models, _packable_dtypes()) if m.weight.device.type == "cpu"]


# packed_cpu_linears' copies between its blocks, per module (off the module: a model stays deep-copyable and
# picklable between generations); each entry [packed weight, weight version, weight pointer] follows its weight.
_PACKED_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pack_cpu_linears(*models: torch.nn.Module) -> int:
    """Pack the weights of every ``nn.Linear`` (exactly that class, without a patched forward) in ``models`` whose
    weight is a plain fp32 CPU tensor, or bf16 where the CPU has oneDNN bf16 kernels; returns how many were packed
    (0 where oneDNN is unavailable)."""
    modules = _cpu_linears(models)
    for module in modules:
        state = _PACKED_COPIES.pop(module, None) or _pack(module.weight)
        setattr(module, _PACKED, state)
        module.forward = _packed_forward(module, state)
    return len(modules)


def unpack_cpu_linears(*models: torch.nn.Module) -> int:
    """Undo :func:`pack_cpu_linears` on ``models`` and free the packed copies (also those that
    :func:`packed_cpu_linears` keeps between calls); returns how many modules held one."""
    kept = 0
    for model in models:
        for module in model.modules():
            kept += _PACKED_COPIES.pop(module, None) is not None
    return _restore(models, _PACKED) + kept


# Share of the host's available memory the packed copies may take when packing is chosen by default.
PACKED_MEMORY_SHARE = 0.25


def packing_fits(*models: torch.nn.Module) -> bool:
    """Whether the packed copies that :func:`packed_cpu_linears` would add fit in :data:`PACKED_MEMORY_SHARE` of the
    available host memory (the default's rule: a big model on a small machine is not doubled silently)."""
    new = sum(m.weight.numel() * m.weight.element_size() for m in _cpu_linears(models) if m not in _PACKED_COPIES)
    free = _available_memory()
    return new == 0 or (free is not None and new <= PACKED_MEMORY_SHARE * free)


def generation_packing(options, device, models, target_step: str = "eager") -> contextlib.AbstractContextManager:
    """The block a generation on ``device`` runs its ``models`` in, as ``options.packed_linears``
    (:class:`~modeling_weaver.options.StepOptions`) says: packed CPU linears, or nothing. Compiled steps trace the
    plain linears (the packed call's weight-version check is data-dependent for the compiler)."""
    on = options.packed_linears
    if (torch.device(device).type != "cpu" or target_step == "compiled" or on is False
            or (on is None and not packing_fits(*models))):
        return contextlib.nullcontext()
    return packed_cpu_linears(*models)


@contextlib.contextmanager
def packed_cpu_linears(*models: torch.nn.Module):
    """Route the CPU linears of ``models`` through prepacked weights inside the block only; yields how many.

    Outside it the modules run ``F.linear`` again (transformers' ``generate`` after it is unchanged), while the packed
    copies stay on the modules for the next block — one copy of the linear weights, freed by
    :func:`unpack_cpu_linears`. Modules already routed (by :func:`pack_cpu_linears`, or an enclosing block) are left
    as they are."""
    modules = _cpu_linears(models)
    try:
        for module in modules:
            if module not in _PACKED_COPIES:
                _PACKED_COPIES[module] = _pack(module.weight)
            module.forward = _packed_forward(module, _PACKED_COPIES[module])
        yield len(modules)
    finally:
        for module in modules:
            module.__dict__.pop("forward", None)


def _int8_forward(module: torch.nn.Linear, max_rows: int):
    def forward(x: torch.Tensor) -> torch.Tensor:
        if (x.numel() > max_rows * x.shape[-1]
                or (torch.is_grad_enabled() and (module.weight.requires_grad or x.requires_grad))):
            return F.linear(x, module.weight, module.bias)
        q, scale, packed = getattr(module, _INT8)
        if packed is not None and x.device.type == "cpu" and not torch.compiler.is_compiling():
            return weaver_kernels.cpu_int8_linear(x, packed)
        return weaver_kernels.int8_linear(x, q, scale, module.bias)

    return forward


@torch.no_grad()
def int8_linears(*models: torch.nn.Module, max_rows: int = 64) -> int:
    """Route the calls of at most ``max_rows`` rows of every ``nn.Linear`` in ``models`` (exactly that class, without
    a patched forward: not after :func:`pack_cpu_linears`) through an int8 copy of its weight; returns how many."""
    count = 0
    for module in list(_plain_linears(models)):
        q, scale = weaver_kernels.quantize_rows(module.weight)
        cpu = module.weight.device.type == "cpu" and weaver_kernels.cpu_int8_available()
        setattr(module, _INT8, (q, scale, weaver_kernels.cpu_int8_pack(q, scale, module.bias) if cpu else None))
        module.forward = _int8_forward(module, max_rows)
        count += 1
    if count:
        _release_steps(models)
    return count


def remove_int8_linears(*models: torch.nn.Module) -> int:
    """Undo :func:`int8_linears` on ``models``; returns how many modules were restored."""
    count = _restore(models, _INT8)
    if count:
        _release_steps(models)
    return count


def _release_steps(models) -> None:
    """Drop the models' captured and compiled steps: they were traced through the linears' previous forward."""
    from .decoding.step_cache import release_static_targets

    for model in models:
        release_static_targets(model)

"""Other weight forms for a model's linears at inference: prepacked oneDNN weights on a CPU, int8 weights for a
drafter on a GPU.

**CPU: prepacked oneDNN weights** — the same models, 1.5-4× faster GEMMs on a CPU.

PyTorch's CPU ``F.linear`` hands each call to MKL, which re-packs the weight every time; at the row counts of decoding
(1 token, or a tree of 9-65 nodes) that packing is most of the work. :func:`pack_cpu_linears` packs every
``nn.Linear`` weight of the given models once into oneDNN's blocked layout and routes the module's calls through it
(timings: BENCHMARKS.md, the CPU demo). It is an inference switch of the models themselves, so every caller sees
the same linears — transformers' ``generate``, our AR path and the speculative loop alike — and their greedy outputs
stay comparable token for token. The cost is one packed copy of each weight (+ the model's linear weights in memory).

A packed module falls back to ``F.linear`` where the packed form does not apply: a non-CPU input, another dtype, or
autograd (a weight or input that requires grad under grad mode). A weight changed in place or replaced is re-packed
at its next call. :func:`unpack_cpu_linears` restores the modules.

**int8 weights for a drafter** — :func:`int8_linears` routes every ``nn.Linear`` call of at most ``max_rows`` rows
through an int8 copy of the weight (one scale per output row, ``weaver_kernels.int8_linear``: on CUDA one Triton
launch reading each weight byte once, half of bf16's bytes; elsewhere the torch reference, which dequantises on every
call). Meant for drafters, whose outputs only shape proposal trees: a speculative step's drafting is a few rows
through the drafter's whole weights, memory-bound. Calls with more rows (a prompt's context) and autograd use the
original weight. The copy is made once: after changing the weights, :func:`remove_int8_linears` and apply it again.
Both drop the models' cached fixed-shape steps (CUDA graphs and compiled steps traced through the old forward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import weaver_kernels

_PACKED = "_weaver_packed_weight"  # the module attribute holding [packed weight, weight version, weight pointer]
_INT8 = "_weaver_int8_weight"  # the module attribute holding (int8 weight, row scales)


def _available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _pack(weight: torch.Tensor) -> list:
    return [torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None), weight._version, weight.data_ptr()]


def _packed_forward(module: torch.nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        w = module.weight
        if (x.device.type != "cpu" or w.device.type != "cpu" or x.dtype != w.dtype
                or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))):
            return F.linear(x, w, module.bias)
        state = getattr(module, _PACKED)
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


def pack_cpu_linears(*models: torch.nn.Module) -> int:
    """Pack the weights of every ``nn.Linear`` (exactly that class, without a patched forward) in ``models`` whose
    weight is a plain fp32 or bf16 CPU tensor; returns how many were packed (0 where oneDNN is unavailable)."""
    if not _available():
        return 0
    count = 0
    for module in list(_plain_linears(models, (torch.float32, torch.bfloat16))):
        if module.weight.device.type == "cpu":
            setattr(module, _PACKED, _pack(module.weight))
            module.forward = _packed_forward(module)
            count += 1
    return count


def unpack_cpu_linears(*models: torch.nn.Module) -> int:
    """Undo :func:`pack_cpu_linears` on ``models``; returns how many modules were restored."""
    return _restore(models, _PACKED)


def _int8_forward(module: torch.nn.Linear, max_rows: int):
    def forward(x: torch.Tensor) -> torch.Tensor:
        if (x.numel() > max_rows * x.shape[-1]
                or (torch.is_grad_enabled() and (module.weight.requires_grad or x.requires_grad))):
            return F.linear(x, module.weight, module.bias)
        return weaver_kernels.int8_linear(x, *getattr(module, _INT8), module.bias)

    return forward


@torch.no_grad()
def int8_linears(*models: torch.nn.Module, max_rows: int = 64) -> int:
    """Route the calls of at most ``max_rows`` rows of every ``nn.Linear`` in ``models`` (exactly that class, without
    a patched forward: not after :func:`pack_cpu_linears`) through an int8 copy of its weight; returns how many."""
    count = 0
    for module in list(_plain_linears(models)):
        setattr(module, _INT8, weaver_kernels.quantize_rows(module.weight))
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

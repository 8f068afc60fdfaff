"""modeling-weaver: lossless tree speculative decoding (DFlash drafters + Weaver trees) for transformers.

One speculative step, top to bottom: :mod:`.generate` (the loop) → :mod:`.modeling_dflash` (draft) →
:mod:`.tree` (chain / DDTree / Weaver trees, with :mod:`.modeling_weaver`) → :mod:`.target` (verify and commit)
→ :mod:`.accept` (greedy, target-only sampling, traversal verification).
"""

from __future__ import annotations

import importlib
import sys
import types

# Public names → the module that defines them. Imported on first access (PEP 562), so that ``import modeling_weaver``
# and ``weaver --help`` stay quick: torch and transformers load only when a model, config or loop is used.
_EXPORTS = {
    "Acceptance": ".accept", "accept_greedy": ".accept", "accept_target_only": ".accept",
    "accept_traversal": ".accept",
    "DFlashConfig": ".configuration_dflash",
    "WeaverConfig": ".configuration_weaver",
    "SpeculativeStats": ".generate", "generate": ".generate", "speculative_generate": ".generate",
    "DFlashDraftModel": ".modeling_dflash",
    "WeaverModel": ".modeling_weaver",
    "int8_linears": ".packed", "pack_cpu_linears": ".packed", "remove_int8_linears": ".packed",
    "unpack_cpu_linears": ".packed",
    "BudgetPolicy": ".options", "StepOptions": ".options", "TreePolicy": ".options",
    "TargetAdapter": ".target",
    "Tree": ".tree", "chain_tree": ".tree", "ddtree": ".tree", "weaver_tree": ".tree",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


class _Package(types.ModuleType):
    """Keeps ``modeling_weaver.generate`` the function: importing the submodule of the same name (which the import
    system then sets on the package) must not replace it, as it would not have when everything loaded eagerly."""

    def __setattr__(self, name, value):
        if (name in _EXPORTS and isinstance(value, types.ModuleType)
                and value.__name__ == f"{__name__}.{name}" and hasattr(value, name)):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__version__ = "0.1.0"

__all__ = [
    "Acceptance",
    "BudgetPolicy",
    "DFlashConfig",
    "DFlashDraftModel",
    "SpeculativeStats",
    "StepOptions",
    "TargetAdapter",
    "Tree",
    "TreePolicy",
    "WeaverConfig",
    "WeaverModel",
    "accept_greedy",
    "accept_target_only",
    "accept_traversal",
    "chain_tree",
    "ddtree",
    "generate",
    "pack_cpu_linears",
    "speculative_generate",
    "unpack_cpu_linears",
    "weaver_tree",
]

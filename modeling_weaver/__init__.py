"""modeling-weaver: lossless tree speculative decoding (DFlash drafters + Weaver trees) for transformers.

One speculative step, top to bottom: :mod:`.generate` (the loop) → :mod:`.modeling_dflash` (draft) →
:mod:`.tree` (chain / DDTree / Weaver trees, with :mod:`.modeling_weaver`) → :mod:`.target` (verify and commit)
→ :mod:`.accept` (greedy, target-only sampling, traversal verification).
"""

from .accept import Acceptance, accept_greedy, accept_target_only, accept_traversal
from .configuration_dflash import DFlashConfig
from .configuration_weaver import WeaverConfig
from .generate import SpeculativeStats, generate, speculative_generate
from .modeling_dflash import DFlashDraftModel
from .modeling_weaver import WeaverModel
from .options import StepOptions, TreePolicy
from .packed import int8_linears, pack_cpu_linears, remove_int8_linears, unpack_cpu_linears
from .target import TargetAdapter
from .tree import Tree, chain_tree, ddtree, weaver_tree

__version__ = "0.1.0"

__all__ = [
    "Acceptance",
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

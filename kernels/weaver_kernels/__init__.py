"""Tree-verification kernels for modeling-weaver (directory ``kernels/``, import name ``weaver_kernels``).

Four ops are the seams the target adapters call; each is a ``torch.library`` custom op (``weaver::*``, see
:mod:`.ops`) that runs a Triton kernel on CUDA tensors and the plain torch reference beside it otherwise:

- :func:`gdn_tree_verify` — gated delta rule over a tree from the committed state (masked triangular solve).
- :func:`gdn_tree_commit` — advance the committed state along the accepted path (in place, no re-solve).
- :func:`conv_tree` — depthwise causal conv1d (+ SiLU) where each node reads its ancestors.
- :func:`conv_tree_commit` — slide the committed conv window along the accepted path (in place).

Kernels: :mod:`.gdn_tree.chunk` (verify + commit), :mod:`.conv_tree.conv`, and the mainline recurrent baseline
:mod:`.gdn_tree.baseline` (benchmarks only). References: ``*.naive``.
"""

from .conv_tree.naive import conv_tree_commit_ref, conv_tree_ref
from .gdn_tree.naive import gdn_recurrent_ref, gdn_tree_commit_ref, gdn_tree_verify_ref
from .ops import conv_tree, conv_tree_commit, gdn_tree_commit, gdn_tree_verify, max_tree_nodes

__all__ = [
    "gdn_tree_verify",
    "gdn_tree_commit",
    "conv_tree",
    "conv_tree_commit",
    "max_tree_nodes",
    "gdn_tree_verify_ref",
    "gdn_tree_commit_ref",
    "gdn_recurrent_ref",
    "conv_tree_ref",
    "conv_tree_commit_ref",
]

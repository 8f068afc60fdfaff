"""Tree-verification kernels for modeling-weaver (directory ``kernels/``, import name ``weaver_kernels``).

The ops are the seams the target adapters call; each is a ``torch.library`` custom op (``weaver::*``, see
:mod:`.ops`) that runs a Triton kernel on CUDA tensors and the plain torch reference beside it otherwise. The tree
seams:

- :func:`gdn_tree_verify` — gated delta rule over a tree from the committed state (masked triangular solve).
- :func:`gdn_tree_commit` — advance the committed state along the accepted path (in place, no re-solve).
- :func:`conv_tree` — depthwise causal conv1d (+ SiLU) where each node reads its ancestors.
- :func:`conv_tree_commit` — slide the committed conv window along the accepted path (in place).
- :func:`kda_tree_verify`, :func:`kda_tree_commit` — the same pair for Kimi Delta Attention (per-channel gates), and
  :func:`kda_decode` (its one-token AR step; the torch reference on every device).

For the AR step (one token, committed at once), :func:`gdn_decode` and :func:`conv_decode` do verify and commit in
one launch each (the GDN one with the layer's gated RMSNorm). Then :func:`tree_attention` (a tree's queries over a
static KV cache, split over the cache rows: a captured step's cost follows the used length, not the cache size) and
:func:`rms_norm` (transformers' RMSNorm forms in one launch: the decode step runs ~200 of them). For the Weaver
tree build, :func:`node_attention` (a layer's RoPE, node K/V writes and attention for a round's nodes in one launch),
:func:`pool_scores` and :func:`weaver_expand`: one expansion round's candidate scoring and frontier bookkeeping in
two launches (on a CPU, native C kernels, :mod:`.weaver_tree.cpu`, which also hold the rest of a CPU build's
stages between its GEMMs). For drafters, :func:`int8_linear` (a few rows through int8 weights: the draft's lm_head), and on a
CPU :func:`cpu_int8_linear` (fbgemm's int8 GEMM on a prepacked copy; activations rounded too: drafts only).

Kernels: :mod:`.gdn_tree.chunk` (verify: the forms in :mod:`.gdn_tree.fused`, :mod:`.gdn_tree.resident` and
:mod:`.gdn_tree.neumann`, chosen in :mod:`.gdn_tree.dispatch`), :mod:`.gdn_tree.commit`, :mod:`.conv_tree.conv`,
:mod:`.tree_attention.split`, :mod:`.gdn_tree.fused_recurrent` (one-token decode), :mod:`.rms_norm.fused`,
:mod:`.weaver_tree.expand`, :mod:`.weaver_tree.attention`, :mod:`.int8_linear.skinny`, and the mainline recurrent
baseline :mod:`.gdn_tree.baseline` (benchmarks only); the Triton helpers they share: :mod:`.triton_utils`.
References: ``*.naive``.
"""

from .conv_tree.naive import conv_decode_ref, conv_tree_commit_ref, conv_tree_ref
from .gdn_tree.naive import gdn_decode_ref, gdn_gates, gdn_recurrent_ref, gdn_tree_commit_ref, gdn_tree_verify_ref
from .int8_linear.cpu import cpu_int8_available, cpu_int8_linear, cpu_int8_pack
from .int8_linear.naive import int8_linear_ref, quantize_rows
from .kda_tree.naive import kda_decode_ref, kda_gates, kda_recurrent_ref, kda_tree_commit_ref, kda_tree_verify_ref
from .ops import (conv_decode, conv_tree, conv_tree_commit, gdn_decode, gdn_tree_commit, gdn_tree_verify,
                  int8_linear, kda_decode, kda_tree_commit, kda_tree_verify, max_tree_nodes, node_attention,
                  pool_scores, rms_norm, tree_attention, weaver_expand)
from .rms_norm.naive import GATED as RMS_GATED
from .rms_norm.naive import GATED_SIGMOID as RMS_GATED_SIGMOID
from .rms_norm.naive import ONE_PLUS as RMS_ONE_PLUS
from .rms_norm.naive import WEIGHT as RMS_WEIGHT
from .rms_norm.naive import rms_norm_ref
from .tree_attention.naive import tree_attention_mask, tree_attention_ref
from .utils import NODE_ATTENTION_MAX_ROWS
from .weaver_tree.naive import node_attention_ref, pool_scores_ref, weaver_expand_ref

__all__ = [
    "NODE_ATTENTION_MAX_ROWS",
    "cpu_int8_available",
    "cpu_int8_linear",
    "cpu_int8_pack",
    "gdn_tree_verify",
    "gdn_tree_commit",
    "conv_tree",
    "conv_tree_commit",
    "max_tree_nodes",
    "gdn_decode",
    "conv_decode",
    "gdn_decode_ref",
    "gdn_gates",
    "conv_decode_ref",
    "rms_norm",
    "tree_attention",
    "tree_attention_ref",
    "tree_attention_mask",
    "rms_norm_ref",
    "pool_scores",
    "weaver_expand",
    "node_attention",
    "node_attention_ref",
    "pool_scores_ref",
    "weaver_expand_ref",
    "int8_linear",
    "int8_linear_ref",
    "quantize_rows",
    "RMS_WEIGHT",
    "RMS_ONE_PLUS",
    "RMS_GATED",
    "RMS_GATED_SIGMOID",
    "gdn_tree_verify_ref",
    "gdn_tree_commit_ref",
    "gdn_recurrent_ref",
    "conv_tree_ref",
    "conv_tree_commit_ref",
    "kda_tree_verify",
    "kda_tree_commit",
    "kda_decode",
    "kda_decode_ref",
    "kda_gates",
    "kda_tree_verify_ref",
    "kda_tree_commit_ref",
    "kda_recurrent_ref",
]

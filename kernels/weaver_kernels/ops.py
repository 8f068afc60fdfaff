"""``torch.library`` custom ops ``weaver::*`` for the tree seams, the one-token decode, tree attention and RMSNorm,
with fake (meta) implementations.

Dispatch: Triton kernels for CUDA tensors, the plain torch references otherwise (CPU; ``kda_decode``'s on every
device: it has no Triton kernel); on a CPU, the Weaver build's three ops run native C kernels
(:mod:`.weaver_tree.cpu`) where they build. Being custom ops with fake implementations, they trace as single
opaque nodes: ``torch.compile(fullgraph=True)`` of a layer's tree forward has no graph breaks, and the commits are
declared as in-place mutations (``mutates_args``), so functionalization handles them. Triton is imported only when a
CUDA tensor arrives (CPU-only installs never need it).

The public functions below keep the reference signatures (``weaver_kernels.gdn_tree_verify`` etc.); for CPU tensors
outside a trace they run the op's function directly (:func:`_call`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .conv_tree.naive import conv_decode_ref, conv_tree_commit_ref, conv_tree_ref
from .gdn_tree.naive import gdn_decode_ref, gdn_tree_commit_ref, gdn_tree_verify_ref
from .int8_linear.naive import int8_linear_ref
from .kda_tree.naive import kda_decode_ref, kda_tree_commit_ref, kda_tree_verify_ref
from .rms_norm.naive import GATED_KINDS, rms_norm_ref
from .tree_attention.naive import tree_attention_ref
from .weaver_tree import cpu as weaver_cpu
from .weaver_tree.naive import node_attention_ref, pool_scores_ref, weaver_expand_ref


def max_tree_nodes(device) -> int | None:
    """Largest tree the GDN and KDA verify ops take on ``device`` (the Triton kernels' limit on CUDA, the same for
    both; None = unbounded)."""
    if torch.device(device).type != "cuda":
        return None
    from .gdn_tree.dispatch import MAX_NODES

    return MAX_NODES


def _contig(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()


_BODIES: dict = {}  # custom op → the Python function it runs


def _op(name: str, mutates_args=()):
    """``torch.library.custom_op`` that keeps the function it wraps, for :func:`_call`."""
    def register(fn):
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        _BODIES[op] = fn
        return op

    return register


def _call(op, *args):
    """``op(*args)``; for CPU tensors (``args[0]``'s device) outside a trace, the op's own function called directly:
    the same code, without the dispatcher's per-call cost (tens of µs, most of a small op's time in a CPU decoding
    step)."""
    if args[0].device.type == "cpu" and not torch.compiler.is_compiling():
        return _BODIES[op](*args)
    return op(*args)


# ---------------------------------------------------------------------------------------------------------- GDN
@_op("weaver::gdn_tree_verify", mutates_args=())
def _gdn_tree_verify_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor,
    tree_mask: Tensor,
    scale: float,
    use_qk_l2norm_in_kernel: bool,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    peel_root: bool,
    max_depth: int,
) -> tuple[Tensor, Tensor, Tensor]:
    args = (q, k, v, g, beta, initial_state, tree_mask, scale, use_qk_l2norm_in_kernel)
    if q.is_cuda:
        from .gdn_tree.chunk import gdn_tree_verify_triton

        return gdn_tree_verify_triton(*args, A_log=A_log, dt_bias=dt_bias, peel_root=peel_root,
                                      max_depth=max_depth if max_depth >= 0 else None)
    o, u, gamma = gdn_tree_verify_ref(*args, A_log=A_log, dt_bias=dt_bias)
    return _contig(o), _contig(u), _contig(gamma)


@_gdn_tree_verify_op.register_fake
def _(q, k, v, g, beta, initial_state, tree_mask, scale, use_qk_l2norm_in_kernel, A_log, dt_bias, peel_root, max_depth):
    B, T, HV, V = v.shape
    acc = torch.promote_types(v.dtype, torch.float32)
    return v.new_empty((B, T, HV, V)), v.new_empty((B, T, HV, V), dtype=acc), v.new_empty((B, T, HV), dtype=acc)


@_op("weaver::gdn_tree_commit", mutates_args=("state",))
def _gdn_tree_commit_op(
    state: Tensor, k: Tensor, u: Tensor, gamma: Tensor, path: Tensor, use_qk_l2norm_in_kernel: bool
) -> None:
    if state.is_cuda:
        from .gdn_tree.commit import gdn_tree_commit_triton

        gdn_tree_commit_triton(state, k, u, gamma, path, use_qk_l2norm_in_kernel)
    else:
        gdn_tree_commit_ref(state, k, u, gamma, path, use_qk_l2norm_in_kernel)


@_gdn_tree_commit_op.register_fake
def _(state, k, u, gamma, path, use_qk_l2norm_in_kernel):
    return None


@_op("weaver::gdn_decode", mutates_args=("state",))
def _gdn_decode_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, norm_weight: Tensor | None,
    gate: Tensor | None, scale: float, eps: float, use_qk_l2norm_in_kernel: bool, A_log: Tensor | None,
    dt_bias: Tensor | None
) -> Tensor:
    args = (q, k, v, g, beta, state, norm_weight, gate, scale, eps, use_qk_l2norm_in_kernel, A_log, dt_bias)
    if q.is_cuda:
        from .gdn_tree.fused_recurrent import gdn_decode_triton

        return gdn_decode_triton(*args)
    return _contig(gdn_decode_ref(*args))


@_gdn_decode_op.register_fake
def _(q, k, v, g, beta, state, norm_weight, gate, scale, eps, use_qk_l2norm_in_kernel, A_log, dt_bias):
    return v.new_empty(v.shape)


# ---------------------------------------------------------------------------------------------------------- KDA
@_op("weaver::kda_tree_verify", mutates_args=())
def _kda_tree_verify_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor,
    tree_mask: Tensor,
    scale: float,
    use_qk_l2norm_in_kernel: bool,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    args = (q, k, v, g, beta, initial_state, tree_mask, scale, use_qk_l2norm_in_kernel)
    if q.is_cuda:
        from .kda_tree import fused, strip

        verify = strip.kda_tree_verify_strip if q.shape[1] <= strip.MAX_NODES else fused.kda_tree_verify_triton
        return verify(*args, A_log=A_log, dt_bias=dt_bias)
    o, u, gamma = kda_tree_verify_ref(*args, A_log=A_log, dt_bias=dt_bias)
    return _contig(o), _contig(u), _contig(gamma)


@_kda_tree_verify_op.register_fake
def _(q, k, v, g, beta, initial_state, tree_mask, scale, use_qk_l2norm_in_kernel, A_log, dt_bias):
    B, T, HV, V = v.shape
    acc = torch.promote_types(v.dtype, torch.float32)
    return (v.new_empty((B, T, HV, V)), v.new_empty((B, T, HV, V), dtype=acc),
            v.new_empty((B, T, HV, q.shape[-1]), dtype=acc))


@_op("weaver::kda_tree_commit", mutates_args=("state",))
def _kda_tree_commit_op(
    state: Tensor, k: Tensor, u: Tensor, gamma: Tensor, path: Tensor, use_qk_l2norm_in_kernel: bool
) -> None:
    if state.is_cuda:
        from .kda_tree.commit import kda_tree_commit_triton

        kda_tree_commit_triton(state, k, u, gamma, path, use_qk_l2norm_in_kernel)
    else:
        kda_tree_commit_ref(state, k, u, gamma, path, use_qk_l2norm_in_kernel)


@_kda_tree_commit_op.register_fake
def _(state, k, u, gamma, path, use_qk_l2norm_in_kernel):
    return None


@_op("weaver::kda_decode", mutates_args=("state",))
def _kda_decode_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, scale: float,
    use_qk_l2norm_in_kernel: bool, A_log: Tensor | None, dt_bias: Tensor | None
) -> Tensor:
    return _contig(kda_decode_ref(q, k, v, g, beta, state, scale, use_qk_l2norm_in_kernel, A_log, dt_bias))


@_kda_decode_op.register_fake
def _(q, k, v, g, beta, state, scale, use_qk_l2norm_in_kernel, A_log, dt_bias):
    return v.new_empty(v.shape)


# --------------------------------------------------------------------------------------------------------- conv
@_op("weaver::conv_tree", mutates_args=())
def _conv_tree_op(
    x: Tensor, window: Tensor, weight: Tensor, bias: Tensor | None, parents: Tensor, activation: str | None
) -> Tensor:
    if x.is_cuda:
        from .conv_tree.conv import conv_tree_triton

        return conv_tree_triton(x, window, weight, bias, parents, activation)
    return _contig(conv_tree_ref(x, window, weight, bias, parents, activation))


@_conv_tree_op.register_fake
def _(x, window, weight, bias, parents, activation):
    return x.new_empty(x.shape)


@_op("weaver::conv_tree_commit", mutates_args=("window",))
def _conv_tree_commit_op(window: Tensor, x: Tensor, path: Tensor) -> None:
    if window.is_cuda:
        from .conv_tree.conv import conv_tree_commit_triton

        conv_tree_commit_triton(window, x, path)
    else:
        conv_tree_commit_ref(window, x, path)


@_conv_tree_commit_op.register_fake
def _(window, x, path):
    return None


@_op("weaver::conv_decode", mutates_args=("window",))
def _conv_decode_op(x: Tensor, window: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None) -> Tensor:
    if x.is_cuda:
        from .conv_tree.conv import conv_decode_triton

        return conv_decode_triton(x, window, weight, bias, activation)
    return _contig(conv_decode_ref(x, window, weight, bias, activation))


@_conv_decode_op.register_fake
def _(x, window, weight, bias, activation):
    return x.new_empty(x.shape)


# ----------------------------------------------------------------------------------------------- tree attention
@_op("weaver::tree_attention", mutates_args=())
def _tree_attention_op(
    q: Tensor, keys: Tensor, values: Tensor, tree_mask: Tensor, length: Tensor, bound: int, scale: float,
    window: int = 0, depths: Tensor | None = None, sinks: Tensor | None = None, visible: Tensor | None = None,
) -> Tensor:
    if q.is_cuda:
        from .tree_attention.split import tree_attention_triton

        return tree_attention_triton(q, keys, values, tree_mask, length, bound, scale, window=window, depths=depths,
                                     sinks=sinks)
    return _contig(tree_attention_ref(q, keys, values, tree_mask, length, bound, scale, window, depths, sinks,
                                      visible))


@_tree_attention_op.register_fake
def _(q, keys, values, tree_mask, length, bound, scale, window=0, depths=None, sinks=None, visible=None):
    _, H, N, D = q.shape
    return q.new_empty((1, N, H * D))


# ------------------------------------------------------------------------------------------------- Weaver tree
@_op("weaver::pool_scores", mutates_args=())
def _pool_scores_op(query: Tensor, rows: Tensor, pool_ids: Tensor, pool_logits: Tensor, weight: Tensor) -> Tensor:
    if query.is_cuda:
        from .weaver_tree.expand import pool_scores_triton

        return pool_scores_triton(query, rows, pool_ids, pool_logits, weight)
    if weaver_cpu.supports(query, rows, pool_ids, pool_logits, weight) and pool_logits.dtype == torch.float32:
        return weaver_cpu.pool_scores(query, rows, pool_ids, pool_logits, weight)
    return _contig(pool_scores_ref(query, rows, pool_ids, pool_logits, weight))


@_pool_scores_op.register_fake
def _(query, rows, pool_ids, pool_logits, weight):
    return query.new_empty((query.shape[0], pool_ids.shape[1]), dtype=torch.float32)


@_op("weaver::node_attention", mutates_args=("node_k", "node_v"))
def _node_attention_op(qkv: Tensor, positions: Tensor, prompt_k: Tensor, prompt_v: Tensor, node_k: Tensor,
                       node_v: Tensor, mask: Tensor, lo: int, rope_base: float, scale: float) -> Tensor:
    args = (qkv, positions, prompt_k, prompt_v, node_k, node_v, mask, lo, rope_base, scale)
    if qkv.is_cuda:
        from .weaver_tree.attention import node_attention_triton

        return node_attention_triton(*args)
    if weaver_cpu.supports(qkv, positions, prompt_k, prompt_v, node_k, node_v, mask) and mask.dtype == torch.bool:
        return weaver_cpu.node_attention(*args)
    return _contig(node_attention_ref(*args))


@_node_attention_op.register_fake
def _(qkv, positions, prompt_k, prompt_v, node_k, node_v, mask, lo, rope_base, scale):
    return qkv.new_empty((qkv.shape[0], node_k.shape[0] * node_k.shape[2]))


_EXPAND_DTYPES = (torch.float32, torch.long, torch.long, torch.long, torch.float32, torch.long, torch.float32,
                  torch.bool, torch.float32, torch.long, torch.float32)  # (what the native CPU kernel takes)


@_op("weaver::weaver_expand", mutates_args=("tokens", "parents", "logq", "depth", "score", "mask", "f_score", "f_token",
                                       "f_logq"))
def _weaver_expand_op(cand: Tensor, pool_ids: Tensor, tokens: Tensor, parents: Tensor, logq: Tensor, depth: Tensor,
                      score: Tensor, mask: Tensor, f_score: Tensor, f_token: Tensor, f_logq: Tensor, lo: int, hi: int,
                      take: int, max_depth: int, spine: int) -> None:
    if cand.is_cuda:
        from .weaver_tree.expand import weaver_expand_triton

        weaver_expand_triton(cand, pool_ids, tokens, parents, logq, depth, score, mask, f_score, f_token, f_logq,
                             lo, hi, take, max_depth, spine)
        return
    buffers = (cand, pool_ids, tokens, parents, logq, depth, score, mask, f_score, f_token, f_logq)
    if weaver_cpu.supports(*buffers) and all(t.dtype == dt for t, dt in zip(buffers, _EXPAND_DTYPES)):
        weaver_cpu.weaver_expand(*buffers, lo, hi, take, max_depth, spine)
        return
    weaver_expand_ref(cand, pool_ids, tokens, parents, logq, depth, score, mask, f_score, f_token, f_logq, lo, hi,
                      take, max_depth, spine)


@_weaver_expand_op.register_fake
def _(cand, pool_ids, tokens, parents, logq, depth, score, mask, f_score, f_token, f_logq, lo, hi, take, max_depth,
      spine):
    return None


# ------------------------------------------------------------------------------------------------------ RMSNorm
@_op("weaver::rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, weight: Tensor, gate: Tensor | None, eps: float, kind: int) -> Tensor:
    if x.is_cuda:
        from .rms_norm.fused import rms_norm_triton

        return rms_norm_triton(x, weight, gate, eps, kind)
    return _contig(rms_norm_ref(x, weight, gate, eps, kind))


@_rms_norm_op.register_fake
def _(x, weight, gate, eps, kind):
    return x.new_empty(x.shape)


@_op("weaver::int8_linear", mutates_args=())
def _int8_linear_op(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    if x.is_cuda:
        from .int8_linear.skinny import int8_linear_triton

        q, scale = _contig(q), _contig(scale)  # (the kernel steps through both with unit strides)
        if x.dtype == torch.float32:  # (the kernel multiplies in bf16 / fp16 on the tensor cores)
            return int8_linear_triton(x.bfloat16(), q, scale).float()
        return int8_linear_triton(x, q, scale)
    return _contig(int8_linear_ref(x, q, scale))


@_int8_linear_op.register_fake
def _(x, q, scale):
    return x.new_empty((*x.shape[:-1], q.shape[0]))


# ------------------------------------------------------------------------------------------------ public seams
def gdn_tree_verify(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor,
    tree_mask: Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    peel_root: bool = False,
    max_depth: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Tree gated delta rule from the committed state; writes no state. See ``gdn_tree.naive.gdn_tree_verify_ref``.

    Returns ``o [B, T, HV, V]`` (dtype of v), ``u [B, T, HV, V]`` fp32, ``gamma [B, T, HV]`` fp32.
    CUDA: Triton, T ≤ 256 nodes (``gdn_tree.dispatch.MAX_NODES``): one launch, or two for 49-64 nodes (the resident
    form, faster there; ``gdn_tree.dispatch.RESIDENT_NODES``), or, where ``max_depth`` bounds the tree's depth by
    ``gdn_tree.dispatch.NEUMANN_MAX_DEPTH`` (a block drafter's trees: block size − 1), two for 49-64 and 97-128 nodes
    after the root (``gdn_tree.dispatch.NEUMANN_NODES``: the Neumann form, no serial row blocks). ``tree_mask``: the
    ancestor-or-self mask (transitively closed). ``max_depth`` only picks the form: a deeper tree is still solved
    exactly. With ``A_log`` and ``dt_bias``
    (``[HV]``), ``g`` and ``beta`` are the raw gate projections a and b, and the gates are formed in the same launch
    (Qwen3.5's, :func:`~weaver_kernels.gdn_gates`). ``peel_root``: see
    :func:`~weaver_kernels.gdn_tree.chunk.gdn_tree_verify_triton` (CUDA only; the same result either way).
    """
    if (A_log is None) != (dt_bias is None):
        raise ValueError("gdn_tree_verify: A_log and dt_bias go together")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    depth = -1 if max_depth is None else int(max_depth)
    return _call(_gdn_tree_verify_op, q, k, v, g, beta, initial_state, tree_mask, float(scale),
                 bool(use_qk_l2norm_in_kernel), A_log, dt_bias, bool(peel_root), depth)


def gdn_tree_commit(
    state: Tensor, k: Tensor, u: Tensor, gamma: Tensor, path: Tensor, use_qk_l2norm_in_kernel: bool = False
) -> Tensor:
    """Advance ``state`` in place along the accepted ``path`` (root..leaf, may be right-padded with -1); returns it."""
    _call(_gdn_tree_commit_op, state, k, u, gamma, path, bool(use_qk_l2norm_in_kernel))
    return state


def gdn_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    norm_weight: Tensor | None = None,
    gate: Tensor | None = None,
    scale: float | None = None,
    eps: float = 1e-6,
    use_qk_l2norm_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
) -> Tensor:
    """One committed token: q, k ``[B, 1, H, K]``, v ``[B, 1, HV, V]``, g, beta ``[B, 1, HV]``; advances ``state``
    in place and returns o ``[B, 1, HV, V]`` — gated-RMSNormed with ``gate`` when ``norm_weight`` is given. The AR
    step's form of verify + commit (CUDA: one launch). With ``A_log`` and ``dt_bias`` (``[HV]``), ``g`` and ``beta``
    are the raw gate projections a and b, and the gates are formed in the same launch (Qwen3.5's
    ``g = −exp(A_log) · softplus(a + dt_bias)``, ``β = sigmoid(b)``). See ``gdn_tree.naive.gdn_decode_ref``."""
    if (norm_weight is None) != (gate is None):
        raise ValueError("gdn_decode: norm_weight and gate go together")
    if (A_log is None) != (dt_bias is None):
        raise ValueError("gdn_decode: A_log and dt_bias go together")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return _call(_gdn_decode_op, q, k, v, g, beta, state, norm_weight, gate, float(scale), float(eps),
                                       bool(use_qk_l2norm_in_kernel), A_log, dt_bias)


def kda_tree_verify(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor,
    tree_mask: Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Tree Kimi Delta Attention (per-channel gates ``g [B, T, HV, K]``) from the committed state; writes no state.
    See ``kda_tree.naive.kda_tree_verify_ref``. Returns ``o [B, T, HV, V]`` (dtype of v), ``u [B, T, HV, V]`` fp32,
    ``gamma [B, T, HV, K]`` fp32. With ``A_log`` (HV entries) and ``dt_bias`` (HV·K), ``g`` and ``beta`` are the raw
    projections f and b (KimiLinear's gates, :func:`~weaver_kernels.kda_gates`), formed in the verify launch on CUDA.
    CUDA: Triton (``kda_tree.strip``, two launches, up to 64 nodes; ``kda_tree.fused``, three launches, up to 256);
    elsewhere the reference."""
    if (A_log is None) != (dt_bias is None):
        raise ValueError("kda_tree_verify: A_log and dt_bias go together")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return _call(_kda_tree_verify_op, q, k, v, g, beta, initial_state, tree_mask, float(scale),
                 bool(use_qk_l2norm_in_kernel), A_log, dt_bias)


def kda_tree_commit(
    state: Tensor, k: Tensor, u: Tensor, gamma: Tensor, path: Tensor, use_qk_l2norm_in_kernel: bool = False
) -> Tensor:
    """Advance the KDA ``state`` in place along the accepted ``path`` (root..leaf, may be right-padded with -1) from
    :func:`kda_tree_verify`'s ``u`` and ``gamma``; returns it. CUDA: Triton (``kda_tree.commit``, one launch; the
    path stays on the device)."""
    _call(_kda_tree_commit_op, state, k, u, gamma, path, bool(use_qk_l2norm_in_kernel))
    return state


def kda_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
) -> Tensor:
    """One committed KDA token: q, k ``[B, 1, H, K]``, v ``[B, 1, HV, V]``, g ``[B, 1, HV, K]``, beta ``[B, 1, HV]``;
    advances ``state`` in place and returns o ``[B, 1, HV, V]`` (the AR step's form of verify + commit). With
    ``A_log`` and ``dt_bias``, ``g`` and ``beta`` are the raw projections f and b. See
    ``kda_tree.naive.kda_decode_ref`` (the reference on every device: no Triton decode kernel yet; it syncs nothing
    with the host, so CUDA graphs capture it)."""
    if (A_log is None) != (dt_bias is None):
        raise ValueError("kda_decode: A_log and dt_bias go together")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return _call(_kda_decode_op, q, k, v, g, beta, state, float(scale), bool(use_qk_l2norm_in_kernel), A_log, dt_bias)


def conv_decode(x: Tensor, window: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None = "silu"
                ) -> Tensor:
    """One committed token ``x [B, 1, C]``: conv1d output, the window slid in place (CUDA: one launch)."""
    return _call(_conv_decode_op, x, window, weight, bias, activation)


def conv_tree(
    x: Tensor,
    window: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    parents: Tensor,
    activation: str | None = "silu",
) -> Tensor:
    """Depthwise causal conv1d over the tree (+ SiLU); reads the committed window. See ``conv_tree.naive``."""
    return _call(_conv_tree_op, x, window, weight, bias, parents, activation)


def conv_tree_commit(window: Tensor, x: Tensor, path: Tensor) -> Tensor:
    """Slide the committed window in place along ``path`` (may be right-padded with -1); returns it."""
    _call(_conv_tree_commit_op, window, x, path)
    return window


def tree_attention(q: Tensor, keys: Tensor, values: Tensor, tree_mask: Tensor, length: Tensor, bound: int,
                   scale: float, window: int = 0, depths: Tensor | None = None,
                   sinks: Tensor | None = None, visible: Tensor | None = None) -> Tensor:
    """Attention of a tree's queries ``q [1, H, N, D]`` over a KV cache ``[1, HKV, L, D]`` whose rows ``< length``
    are committed and rows ``length .. length+N-1`` hold the tree (see ``tree_attention.naive``); ``[1, N, H * D]``.
    ``window`` (0: none): a sliding window (query position − row position < ``window``), the nodes at positions
    ``length + depths`` (``[N]`` long), or ``length + i`` without ``depths`` (a DFlash block). ``sinks``: ``[H]``
    attention-sink logits (GPT-OSS), in each softmax's denominator only. ``visible``: optional, the ``[N, bound]``
    mask :func:`tree_attention_mask` gives for these arguments, built once by a caller whose layers share it (the
    reference then skips building it per layer; the Triton kernel never reads it).
    CUDA: a split-KV Triton kernel whose cost follows ``length``, not ``bound``; elsewhere masked SDPA."""
    if window < 0:
        raise ValueError(f"tree_attention: window must be >= 0, got {window}")
    return _call(_tree_attention_op, q, keys, values, tree_mask, length, int(bound), float(scale), int(window),
                 depths, sinks, visible)


def pool_scores(query: Tensor, rows: Tensor, pool_ids: Tensor, pool_logits: Tensor, weight: Tensor) -> Tensor:
    """``[M, P]`` fp32 Weaver candidate logits of ``M`` nodes (``weaver_tree.naive``): the pool's DFlash logits plus
    the pool tokens' lm_head rows dotted with each node's query. CUDA: one Triton launch (gather and dot fused)."""
    if (query.dim() != 2 or rows.shape != (query.shape[0],) or pool_ids.shape != pool_logits.shape
            or weight.shape[1] != query.shape[1]):
        raise ValueError(f"pool_scores: query [M, d], rows [M], pool_ids / pool_logits [D, P] and weight [V, d]; got "
                         f"{tuple(query.shape)}, {tuple(rows.shape)}, {tuple(pool_ids.shape)}, "
                         f"{tuple(pool_logits.shape)}, {tuple(weight.shape)}")
    return _call(_pool_scores_op, query, rows, pool_ids, pool_logits, weight)


def int8_linear(x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x [..., K]`` times int8 weights ``q [N, K]`` with per-row ``scale [N]`` (``int8_linear.naive``: from
    ``quantize_rows``), plus ``bias [N]`` if given → ``[..., N]`` in x's dtype. CUDA: one Triton launch reading each
    weight byte once (fp32 inputs are multiplied in bf16 there)."""
    if (q.dtype != torch.int8 or q.dim() != 2 or x.shape[-1] != q.shape[1] or scale.shape != (q.shape[0],)
            or x.dtype not in (torch.float32, torch.bfloat16, torch.float16)
            or not x.device == q.device == scale.device):
        raise ValueError(f"int8_linear: x [..., K] (fp32, bf16 or fp16), q int8 [N, K] and scale [N], on one device; "
                         f"got {tuple(x.shape)} {x.dtype} {x.device}, {tuple(q.shape)} {q.dtype} {q.device}, "
                         f"{tuple(scale.shape)} {scale.device}")
    out = _call(_int8_linear_op, x, q, scale.float())  # (the op makes q and scale contiguous for the kernel)
    return out if bias is None else out + bias


def node_attention(qkv: Tensor, positions: Tensor, prompt_k: Tensor, prompt_v: Tensor, node_k: Tensor,
                   node_v: Tensor, mask: Tensor, lo: int, rope_base: float, scale: float) -> Tensor:
    """One Weaver layer's attention for a round's ``M`` nodes from their ``qkv [M, 3·H·D]`` projection
    (``weaver_tree.naive.node_attention_ref``): RoPE at ``positions``, K/V written into node slots ``lo..``, attention
    over the prompt ``[H, P, D]`` and the node slots ``[H, n, D]`` their ``mask [M, n]`` rows allow; ``[M, H·D]``.
    CUDA: one Triton launch instead of ~10 small kernels."""
    return _call(_node_attention_op, qkv, positions, prompt_k, prompt_v, node_k, node_v, mask, int(lo),
                                           float(rope_base), float(scale))


def weaver_expand(cand: Tensor, pool_ids: Tensor, tokens: Tensor, parents: Tensor, logq: Tensor, depth: Tensor,
                  score: Tensor, mask: Tensor, f_score: Tensor, f_token: Tensor, f_logq: Tensor, lo: int, hi: int,
                  take: int, max_depth: int, spine: int = 0) -> None:
    """One Weaver expansion round's bookkeeping in place (``weaver_tree.naive.weaver_expand_ref``): publish the
    children of nodes ``lo..hi-1`` to the frontier, then make its ``take`` best entries nodes ``hi..``; with
    ``spine``, nodes ``1..spine`` are a chain of first pool candidates whose log-probabilities this round (``lo = 0``)
    fills in. CUDA: one Triton launch instead of ~20 small kernels."""
    n = tokens.shape[0]
    if not 0 <= lo < hi <= n or take < 0 or hi + take > n:
        raise ValueError(f"weaver_expand: nodes {lo}..{hi} and {take} more do not fit {n} nodes")
    if spine < 0 or (spine and (lo != 0 or spine >= hi)):
        raise ValueError(f"weaver_expand: a spine of {spine} nodes goes with the round of nodes 0..{spine} (lo = 0), "
                         f"got nodes {lo}..{hi}")
    fan = f_score.shape[0] // n
    if f_score.shape[0] != n * fan or fan < 1 or f_token.shape != f_score.shape or f_logq.shape != f_score.shape:
        raise ValueError(f"weaver_expand: frontier buffers must hold n * fan entries ({n} nodes), got "
                         f"{tuple(f_score.shape)}, {tuple(f_token.shape)}, {tuple(f_logq.shape)}")
    if cand.dim() != 2 or cand.shape[0] != hi - lo or cand.shape[1] != pool_ids.shape[1] or fan > cand.shape[1]:
        raise ValueError(f"weaver_expand: scores must be [{hi - lo}, pool >= {fan}] matching pool_ids "
                         f"{tuple(pool_ids.shape)}, got {tuple(cand.shape)}")
    if not 1 <= max_depth <= pool_ids.shape[0] or mask.shape != (n, n):
        raise ValueError(f"weaver_expand: max_depth {max_depth} needs that many pool rows (have {pool_ids.shape[0]}) "
                         f"and the mask [{n}, {n}], got {tuple(mask.shape)}")
    _call(_weaver_expand_op, cand, pool_ids, tokens, parents, logq, depth, score, mask, f_score, f_token, f_logq,
                                   int(lo), int(hi), int(take), int(max_depth), int(spine))


def rms_norm(x: Tensor, weight: Tensor, eps: float, kind: int, gate: Tensor | None = None) -> Tensor:
    """RMSNorm over the last dimension in one of transformers' forms (``rms_norm.naive``: 0 Llama, 1 Qwen3.5,
    2 gated Qwen3.5 and 3 gated KimiLinear with ``gate``); output in x's dtype. CUDA: one Triton launch instead of the
    module's 6–9."""
    if (kind in GATED_KINDS) != (gate is not None):
        raise ValueError("rms_norm: a gate goes with kinds 2 and 3 (gated) and only with them")
    return _call(_rms_norm_op, x, weight, gate, float(eps), int(kind))

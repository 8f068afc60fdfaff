"""Target adapters: run a proposal tree through an unmodified transformers causal LM and commit the accepted path.

The adapter reuses the target's own modules (embedding, norms, projections, MLPs, rotary embedding, lm_head) and
keeps its own committed caches, allocated once: attention K/V per full-attention layer (``max_length`` rows; the
compressed latent rows for latent attention); recurrent state and conv window per Gated DeltaNet or Kimi Delta
Attention layer. ``verify`` writes nothing committed: a tree's K/V go to the scratch rows right after the committed
ones; ``commit`` moves the accepted path in (KV compaction inside the buffer; GDN / KDA state advanced from the
verification intermediates, never by re-running the target).

Every tensor op of ``verify`` and ``commit`` has a fixed shape for a fixed tree size and reads the committed length
from a device tensor, so both can be captured in CUDA graphs (pad trees with :meth:`Tree.padded`, attend over the
whole buffer with ``bound=max_length``); eager calls attend over the used rows only.

Supported: Llama, Qwen2, Qwen3, Qwen3-MoE (attention only), Mistral, Gemma3 and GPT-OSS (attention only, every layer
or some on a sliding window; Gemma3's sandwich norms, per-layer-type RoPE and final logit softcapping; GPT-OSS's
attention sinks and MoE), Qwen3.5/3.6 (hybrid GDN + gated attention), and the hybrid MoE families Qwen3.5-MoE and
Qwen3-Next (GDN + gated attention + MoE with a gated shared expert); Qwen3.5 and Qwen3.5-MoE either as
``*ForCausalLM`` or as the text model inside ``*ForConditionalGeneration``; Kimi Linear (Kimi Delta Attention + MLA
without RoPE + MoE with a shared expert: :class:`KimiDeltaAttentionLayerCache`, :class:`LatentAttentionLayerCache`).
A MoE block routes each tree node as a token of its batch (routing is per token).

Sliding-window layers keep full committed K/V rows; the window is applied in the attention mask: a node at position
``n + depth`` sees a committed row or an ancestor-or-self at position ``j`` only where ``n + depth - j < window``
(transformers' ``sliding_window_overlay``).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.modules import module as nn_module

import weaver_kernels

from .options import StepOptions
from .tree import Tree, ancestor_mask_of

ATTENTION_ONLY = ("llama", "qwen2", "qwen3", "qwen3_moe")
# attention only, with sliding-window layers (which the batched sampler does not take)
SLIDING_WINDOW = ("mistral", "gemma3_text", "gpt_oss")
HYBRID_GDN = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
HYBRID_KDA = ("kimi_linear",)  # Kimi Delta Attention + latent attention (MLA)
SUPPORTED = ATTENTION_ONLY + SLIDING_WINDOW + HYBRID_GDN + HYBRID_KDA
SUPPORTED_CLASSES = (
    "LlamaForCausalLM, MistralForCausalLM, Gemma3ForCausalLM, GptOssForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
    "Qwen3MoeForCausalLM, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForCausalLM, "
    "Qwen3_5MoeForConditionalGeneration, Qwen3NextForCausalLM, KimiLinearForCausalLM"
)


@contextlib.contextmanager
def capturable_experts(model: torch.nn.Module, device, target_step: str):
    """The block a generation runs ``model`` in: with fixed-shape steps on CUDA outside bf16, MoE experts run
    through transformers' ``batched_mm`` implementation (the same sums, one GEMM per routed token) instead of
    ``grouped_mm``, whose non-bf16 path reads the group offsets on the host and so cannot be captured in a CUDA
    graph. The model's own setting is restored on exit."""
    # transformers' experts classes (use_experts_implementation) read `self.config._experts_implementation` at every
    # call; their classes all get `_apply_gate` from that decorator, across versions
    configs = {id(c): c for m in model.modules()
               if hasattr(type(m), "_apply_gate") and (c := getattr(m, "config", None)) is not None}
    switch = (target_step in ("graph", "compiled") and torch.device(device).type == "cuda"
              and next(model.parameters()).dtype != torch.bfloat16)
    saved = {k: getattr(c, "_experts_implementation", None) for k, c in configs.items()} if switch else {}
    saved = {k: v for k, v in saved.items() if v in (None, "grouped_mm")}
    try:
        for k in saved:
            configs[k]._experts_implementation = "batched_mm"
        yield
    finally:
        for k, v in saved.items():
            configs[k]._experts_implementation = v


def text_config(config):
    """The text part of a (possibly multimodal) target config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@dataclass
class FusedNorm:
    """An RMSNorm of the target as one :func:`weaver_kernels.rms_norm` launch, called like the module (made by
    :func:`fused_norm`, which checked that ``kind``, ``weight`` and ``eps`` reproduce it)."""

    module: torch.nn.Module
    weight: torch.Tensor
    eps: float
    kind: int

    def __call__(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():  # inductor fuses the module's ops with their neighbours (residual adds)
            return self.module(x) if gate is None else self.module(x, gate)
        return weaver_kernels.rms_norm(x, self.weight, self.eps, self.kind, gate)


def fused_norm(module: torch.nn.Module, dtype: torch.dtype):
    """``module`` (an RMSNorm of the target) as a :class:`FusedNorm`: one launch, called like the module.

    Used when the module is one of the forms the op knows (Llama/Qwen2/Qwen3/Mistral/GPT-OSS/Kimi Linear; the
    zero-centred ``1 + weight`` norm of Qwen3.5, Qwen3.5-MoE, Qwen3-Next and Gemma3; their gated GDN output norms;
    Kimi Linear's sigmoid-gated KDA output norm) and the op's torch reference reproduces it bit for bit on a random
    input here (GPT-OSS casts after the weight multiply: in 16-bit dtypes that is another form, which the check
    finds); anything else keeps the module itself.
    """
    name = type(module).__name__
    kind = (weaver_kernels.RMS_GATED_SIGMOID if name == "KimiLinearRMSNormGated" else
            weaver_kernels.RMS_GATED if name.endswith("RMSNormGated") else
            weaver_kernels.RMS_ONE_PLUS if name in ("Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm", "Qwen3NextRMSNorm",
                                                    "Gemma3RMSNorm") else
            weaver_kernels.RMS_WEIGHT if name in ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm",
                                                  "MistralRMSNorm", "GptOssRMSNorm", "KimiLinearRMSNorm") else None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    weight = getattr(module, "weight", None)
    if kind is None or eps is None or weight is None or weight.dtype != dtype:  # (mixed dtypes would promote)
        return module
    rng = torch.Generator(device=weight.device).manual_seed(0)  # leaves the global RNG alone
    x, gate = (torch.randn(3, weight.shape[0], generator=rng, device=weight.device, dtype=dtype) for _ in range(2))
    if kind not in (weaver_kernels.RMS_GATED, weaver_kernels.RMS_GATED_SIGMOID):
        gate = None
    with torch.no_grad():
        expected = module(x) if gate is None else module(x, gate)
        if not torch.equal(expected, weaver_kernels.rms_norm_ref(x, weight, gate, eps, kind)):
            return module
    return FusedNorm(module, weight, eps, kind)


def compile_static(fn):
    """``torch.compile(fn)`` for fixed-shape decoding steps: whole graph, static shapes.

    Every adapter (cache bucket × tree size) and every proposer (mode × budget) compiles the same code object once,
    and dynamo counts those compiles against one per-code limit (8 by default; past it a ``fullgraph`` compile
    raises): the limit is raised to 64 for this process.
    """
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 64)
    return torch.compile(fn, dynamic=False, fullgraph=True)


def weights_key(*models) -> tuple:
    """Which tensors hold the models' parameters, and where: a cached step reads them through pointers (graphs,
    merged projections, a cast lm_head), so weights moved or re-allocated since (``.to()``,
    ``load_state_dict(assign=True)``) need new steps."""
    def where(p):
        try:
            ptr = p.data_ptr()
        except RuntimeError:  # (tensor subclasses without storage)
            ptr = None
        return id(p), ptr, p.dtype, tuple(p.shape)

    return tuple(where(p) for model in models for p in model.parameters())


def _row_blocks_of_one(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The contiguous tensor whose consecutive row blocks ``tensors`` already are (views of one storage), else None."""
    first = tensors[0]
    offset, storage = first.storage_offset(), first.untyped_storage().data_ptr()
    for t in tensors:
        if (t.numel() == 0 or t.dtype != first.dtype or t.shape[1:] != first.shape[1:] or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset):
            return None
        offset += t.numel()
    shape = (sum(t.shape[0] for t in tensors), *first.shape[1:])
    if offset * first.element_size() > first.untyped_storage().nbytes():
        return None
    return first.detach().new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape)


def merge_rows(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """One tensor whose consecutive row blocks are ``params`` (same values): made once, by moving each parameter's
    data into a view of it (the Parameter objects stay; no second copy is kept); later calls find the views."""
    merged = _row_blocks_of_one(params)
    if merged is not None:
        return merged
    # (a normal tensor even under inference_mode: the parameters must stay usable for training)
    with torch.inference_mode(False), torch.no_grad():
        merged = torch.cat([p.detach() for p in params])
        start = 0
        for p in params:
            p.data = merged[start : start + p.shape[0]]
            start += p.shape[0]
    return merged


def module_device(module: torch.nn.Module, default: torch.device) -> torch.device:
    """Where ``module`` computes: the device of its first parameter or buffer (a layer that accelerate's ``device_map``
    put on one GPU of several), or ``default`` for a module with neither."""
    tensor = next(module.parameters(), None)
    tensor = next(module.buffers(), None) if tensor is None else tensor
    return default if tensor is None else tensor.device


class Hops:
    """One step's tensors on each device a target split over devices needs them on: ``hops(t, device)`` is ``t``
    itself on its own device, else one copy per device for the step (every layer on that device reads the same)."""

    def __init__(self):
        self.copies: dict = {}

    def __call__(self, t, device: torch.device):
        if t is None or t.device == device:
            return t
        key = (id(t), device)
        if key not in self.copies:
            self.copies[key] = (t, t.to(device))  # (t kept: its id stays its own for the step)
        return self.copies[key][1]


def _unmoved(t, device):
    """The hop of a target on one device: every tensor is where it is needed."""
    return t


def output_features(linear: torch.nn.Module) -> int:
    """The width of what ``linear`` returns on this process: its ``out_features``, or under tensor parallelism this
    rank's share (a colwise-sharded projection returns its local shard), found by calling it on one zero row."""
    weight = linear.weight
    if type(weight.data) is torch.Tensor:
        return linear.out_features
    with torch.no_grad():
        return linear(torch.zeros(1, 1, linear.in_features, device=weight.device, dtype=weight.dtype)).shape[-1]


def _hooked(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` does more than its class's forward (hooks, global hooks, a patched forward)."""
    return bool(module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__
                or nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


class SharedInputLinears:
    """Linear modules that read the same input, run as one GEMM over their concatenated weights.

    At batch 1 a decode step is a string of GEMMs that each read their weights once; a Qwen3.5/3.6 layer runs 9 of them
    on 3 inputs (GDN ``in_proj_qkv/z/b/a``, attention ``q/k/v``, MLP ``gate/up``). One launch per input reads the same
    bytes closer to the bandwidth limit (``scripts/bench_projections.py`` measures it). The modules' weights become row
    blocks of one tensor (:func:`merge_rows`: same values, same Parameter objects, saved and loaded as before). Modules
    that cannot share one GEMM (not plain ``nn.Linear``, hooks or a patched forward, tensor-subclass weights such as
    quantized or DTensor ones, mixed dtypes, devices or input sizes, biases on some only) run one by one. The choice is
    made here, once: an adapter built before a hook was added keeps bypassing it.
    """

    def __init__(self, *linears: torch.nn.Module):
        self.linears = linears
        self.sizes = [m.out_features for m in linears]
        self.weight = self.bias = None
        if self._mergeable(linears):
            self.weight = merge_rows([m.weight for m in linears])
            if linears[0].bias is not None:
                self.bias = merge_rows([m.bias for m in linears])

    @staticmethod
    def _mergeable(linears) -> bool:
        def plain(t):
            return type(t.data) is torch.Tensor and t.layout == torch.strided and t.numel() > 0

        if len(linears) < 2 or any(type(m) is not torch.nn.Linear or _hooked(m) for m in linears):
            return False
        w0, has_bias = linears[0].weight, linears[0].bias is not None
        return w0.device.type != "meta" and all(
            plain(m.weight) and m.weight.dtype == w0.dtype and m.weight.device == w0.device
            and m.in_features == linears[0].in_features and (m.bias is not None) == has_bias
            and (not has_bias or (plain(m.bias) and m.bias.dtype == linears[0].bias.dtype))
            for m in linears)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each module's output (views of one GEMM's output when merged)."""
        if self.weight is None:
            return tuple(m(x) for m in self.linears)
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


# down(act(gate(x)) * up(x)); Qwen3NextMLP: the dense layers of Qwen3-Next (``mlp_only_layers``, ``decoder_sparse_step``)
GATED_MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "Qwen3_5MLP", "Qwen3MoeMLP", "Qwen3NextMLP", "MistralMLP",
              "Gemma3MLP", "KimiLinearMLP")


ROUTER_SCORE_MLPS = ("GptOssMLP",)  # MoE blocks that return (output, router scores)


def mlp_forward(mlp: torch.nn.Module):
    """``mlp`` as a callable with gate and up in one GEMM (:class:`SharedInputLinears`) when it is one of the gated
    MLPs of :data:`GATED_MLPS`; any other MLP is called as it is (its output alone for :data:`ROUTER_SCORE_MLPS`)."""
    if type(mlp).__name__ in ROUTER_SCORE_MLPS:
        return lambda x: mlp(x)[0]
    if type(mlp).__name__ not in GATED_MLPS or _hooked(mlp):
        return mlp
    gate_up = SharedInputLinears(mlp.gate_proj, mlp.up_proj)

    def forward(x: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up(x)
        return mlp.down_proj(mlp.act_fn(gate) * up)

    return forward


def layer_norms(layer: torch.nn.Module, dtype: torch.dtype) -> tuple:
    """A decoder layer's norms as (attention input, attention output or None, MLP input, MLP output or None), each a
    :func:`fused_norm`: Gemma3 norms both sublayers' inputs and outputs, Llama-like layers their inputs only."""
    if hasattr(layer, "pre_feedforward_layernorm"):
        names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm")
    else:
        names = ("input_layernorm", None, "post_attention_layernorm", None)
    return tuple(None if name is None else fused_norm(getattr(layer, name), dtype) for name in names)


@dataclass
class TreeOutput:
    """What one target pass over a tree gives the loop.

    Attributes:
        logits: ``[N, V]`` target logits at every node.
        hidden: ``[N, H]`` final-normed hidden state at every node (the lm_head input; Weaver's ``u0``).
        features: ``[N, len(feature_layer_ids) * H]`` outputs of the drafter's target layers, concatenated (transformers'
            ``hidden_states[id + 1]``: the last layer's entry is final-normed).
    """

    logits: torch.Tensor
    hidden: torch.Tensor
    features: torch.Tensor | None


def compact_rows(buffers, rows: torch.Tensor, dst: torch.Tensor) -> None:
    """An attention cache's commit: the accepted tree rows ``rows`` of each ``[1, heads, L, D]`` buffer moved to ``dst``
    (both ``[P]``; rows past the path are scratch)."""
    for buffer in buffers:
        buffer.index_copy_(2, dst, buffer.index_select(2, rows))


class AttentionLayerCache:
    """Committed K/V of one attention layer, and tree attention over prefix + ancestor-or-self.

    Rows ``< n`` are committed; a verified tree's K/V sit in rows ``n .. n+N-1`` until the next commit. A
    sliding-window layer keeps every row too and masks the rows outside its window (``sliding_window``; 0: none): the
    split-KV kernel skips whole splits before every node's window, so a step reads about ``window + N`` rows.
    """

    def __init__(self, attn: torch.nn.Module, config, max_length: int, device, dtype):
        self.attn = attn
        self.head_dim = attn.head_dim
        # Qwen3.5 packs a per-head output gate next to each query head.
        self.gated = attn.q_proj.out_features == 2 * config.num_attention_heads * self.head_dim
        # this rank's heads: all of them, or its shard under tensor parallelism (colwise q/k/v, rowwise o_proj)
        self.num_heads = output_features(attn.q_proj) // (self.head_dim * (2 if self.gated else 1))
        self.num_kv_heads = output_features(attn.k_proj) // self.head_dim
        # Mistral's attention reads the window from its config; the others carry their layer's own (None: full)
        window = (attn.sliding_window if hasattr(attn, "sliding_window")
                  else getattr(attn.config, "sliding_window", None))
        self.sliding_window = int(window or 0)
        self.sinks = getattr(attn, "sinks", None)  # GPT-OSS: a logit per head in each softmax's denominator
        self.apply_rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.qkv = SharedInputLinears(attn.q_proj, attn.k_proj, attn.v_proj)
        self.qk_norm = (fused_norm(attn.q_norm, dtype), fused_norm(attn.k_norm, dtype)) if hasattr(attn, "q_norm") \
            else None
        shape = (1, self.num_kv_heads, max_length, self.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)

    def forward_tree(self, h: torch.Tensor, rope, tree_mask: torch.Tensor, length: torch.Tensor, slots: torch.Tensor,
                     bound: int, depths: torch.Tensor, visible: torch.Tensor | None = None) -> torch.Tensor:
        """``h [1, N, H]`` → attention output ``[1, N, H]``.

        Args:
            tree_mask: ``[N, N]`` bool ancestor-or-self mask of the tree; depths: ``[N]`` each node's depth.
            length: 0-d committed length; slots: ``[N]`` cache rows receiving the tree's K/V (``length + arange(N)``).
            bound: cache rows attended over (the rows past ``length + N`` are masked).
            visible: the step's ``[N, bound]`` attention mask for this layer's window, when built once for all layers
                (:meth:`TargetAdapter.attention_masks`); None: the op builds it.
        """
        attn, N = self.attn, h.shape[1]
        q, k, v = self.qkv(h)
        q = q.view(1, N, self.num_heads, -1)
        if self.gated:
            q, gate = q.chunk(2, dim=-1)
            gate = gate.reshape(1, N, -1)
        k = k.view(1, N, self.num_kv_heads, self.head_dim)
        v = v.view(1, N, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm is not None:
            q, k = self.qk_norm[0](q), self.qk_norm[1](k)
        q, k = self.apply_rotary(q.transpose(1, 2), k.transpose(1, 2), *rope)
        self.keys.index_copy_(2, slots, k.to(self.keys.dtype))
        self.values.index_copy_(2, slots, v.to(self.values.dtype))
        out = weaver_kernels.tree_attention(q, self.keys, self.values, tree_mask, length, bound, attn.scaling,
                                            self.sliding_window, depths, self.sinks, visible)
        if self.gated:
            out = out * torch.sigmoid(gate)
        return attn.o_proj(out)

    def commit(self, rows: torch.Tensor, dst: torch.Tensor):
        compact_rows((self.keys, self.values), rows, dst)


class GatedDeltaNetLayerCache:
    """Committed recurrent state and conv window of one Gated DeltaNet layer, and its tree forward.

    The tree ops are the seams in :mod:`weaver_kernels` (Triton on CUDA, torch reference elsewhere); ``options``
    (:class:`~modeling_weaver.options.StepOptions`) picks how they run: ``gates_in_kernel``, ``peel_root``,
    ``neumann``.
    """

    def __init__(self, gdn: torch.nn.Module, device, dtype, options: StepOptions = StepOptions()):
        self.gdn = gdn
        self.gates_in_kernel, self.peel_root, self.neumann = options.gates_in_kernel, options.peel_root, options.neumann
        self.norm = fused_norm(gdn.norm, dtype)
        # the one-token kernel applies the gated norm itself when it is one the op reproduces (as fused_norm found)
        self.norm_in_kernel = isinstance(self.norm, FusedNorm) and self.norm.kind == weaver_kernels.RMS_GATED
        # Qwen3-Next fuses q/k/v/z and b/a into two projections laid out per key head; Qwen3.5 has four, laid out flat
        self.per_key_head = hasattr(gdn, "in_proj_qkvz")
        self.in_proj = SharedInputLinears(*((gdn.in_proj_qkvz, gdn.in_proj_ba) if self.per_key_head else
                                            (gdn.in_proj_qkv, gdn.in_proj_z, gdn.in_proj_b, gdn.in_proj_a)))
        self.state = torch.zeros(1, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim, device=device, dtype=torch.float32)
        self.window = torch.zeros(1, gdn.conv_dim, gdn.conv_kernel_size - 1, device=device, dtype=dtype)
        self.pending: tuple[torch.Tensor, ...] | None = None

    def _inputs(self, h: torch.Tensor):
        """``h [1, N, H]`` → conv input ``[1, N, conv_dim]``, gate z ``[1, N, HV, V]``, and the raw gate projections
        b and a ``[1, N, HV]`` (:func:`weaver_kernels.gdn_gates` makes β and g of them)."""
        gdn, N = self.gdn, h.shape[1]
        if not self.per_key_head:
            mixed, z, b, a = self.in_proj(h)
            return mixed, z.reshape(1, N, -1, gdn.head_v_dim), b, a
        # Qwen3-Next (its fix_query_key_value_ordering): for each key head, [q, k, v, z] of the value heads it serves
        # in qkvz and [b, a] in ba; gathered here into the flat [q | k | v] conv input and value-head-major z, b, a
        qkvz, ba = self.in_proj(h)
        group = gdn.num_v_heads // gdn.num_k_heads
        q, k, v, z = qkvz.view(1, N, gdn.num_k_heads, -1).split(
            [gdn.head_k_dim, gdn.head_k_dim, group * gdn.head_v_dim, group * gdn.head_v_dim], dim=-1)
        mixed = torch.cat([q.reshape(1, N, -1), k.reshape(1, N, -1), v.reshape(1, N, -1)], dim=-1)
        b, a = (t.reshape(1, N, -1) for t in ba.view(1, N, gdn.num_k_heads, -1).split(group, dim=-1))
        return mixed, z.reshape(1, N, -1, gdn.head_v_dim), b, a

    def _gates(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """What the GDN ops take for the gates: ``(a, b, {A_log, dt_bias})`` — the raw projections, formed into g and
        β inside the op's kernel (no launch of their own) — or, without :attr:`gates_in_kernel`, ``(g, β, {})``."""
        gdn = self.gdn
        if self.gates_in_kernel:
            return a, b, dict(A_log=gdn.A_log, dt_bias=gdn.dt_bias)
        return *weaver_kernels.gdn_gates(a, b, gdn.A_log, gdn.dt_bias), {}

    def _heads(self, conv: torch.Tensor):
        gdn, N = self.gdn, conv.shape[1]
        q, k, v = conv.split([gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
        return (q.reshape(1, N, -1, gdn.head_k_dim), k.reshape(1, N, -1, gdn.head_k_dim),
                v.reshape(1, N, -1, gdn.head_v_dim))

    def _output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        V = self.gdn.head_v_dim
        return self.gdn.out_proj(self.norm(o.reshape(-1, V), z.reshape(-1, V)).reshape(1, o.shape[1], -1))

    def forward_tree(self, h: torch.Tensor, tree_mask: torch.Tensor, parents: torch.Tensor,
                     max_depth: int | None = None) -> torch.Tensor:
        """``max_depth``: a bound on the tree's depth that the caller knows (it picks the verify kernel's form)."""
        gdn = self.gdn
        mixed, z, b, a = self._inputs(h)
        conv = weaver_kernels.conv_tree(
            mixed, self.window, gdn.conv1d.weight.squeeze(1), gdn.conv1d.bias, parents, activation=gdn.activation
        )
        q, k, v = self._heads(conv)
        g, beta, raw = self._gates(a, b)
        o, u, gamma = weaver_kernels.gdn_tree_verify(
            q, k, v, g, beta, self.state, tree_mask, use_qk_l2norm_in_kernel=True, peel_root=self.peel_root,
            max_depth=max_depth if self.neumann else None, **raw
        )
        self.pending = (mixed, k, u, gamma)
        return self._output(o, z)

    def forward_token(self, h: torch.Tensor) -> torch.Tensor:
        """One committed token ``h [1, 1, H]`` (the AR step): window and state advance in place, no pending
        intermediates (one launch each for conv and delta rule instead of tree pass + commit)."""
        gdn = self.gdn
        mixed, z, b, a = self._inputs(h)
        conv = weaver_kernels.conv_decode(mixed, self.window, gdn.conv1d.weight.squeeze(1), gdn.conv1d.bias,
                                          activation=gdn.activation)
        q, k, v = self._heads(conv)
        g, beta, raw = self._gates(a, b)
        if self.norm_in_kernel:
            o = weaver_kernels.gdn_decode(q, k, v, g, beta, self.state, norm_weight=self.norm.weight, gate=z,
                                          eps=self.norm.eps, use_qk_l2norm_in_kernel=True, **raw)
            return gdn.out_proj(o.reshape(1, 1, -1))
        return self._output(weaver_kernels.gdn_decode(q, k, v, g, beta, self.state, use_qk_l2norm_in_kernel=True,
                                                      **raw), z)

    def commit(self, path: torch.Tensor):
        mixed, k, u, gamma = self.pending
        weaver_kernels.conv_tree_commit(self.window, mixed, path)
        weaver_kernels.gdn_tree_commit(self.state, k, u, gamma, path, use_qk_l2norm_in_kernel=True)
        # `pending` stays: a captured commit is warmed up and recorded by calling it several times


class KimiDeltaAttentionLayerCache:
    """Committed recurrent state and conv window of one Kimi Delta Attention layer (Kimi Linear), and its tree forward.

    As a Gated DeltaNet layer's, with per-channel decays: the tree pass reads the committed state ``[1, H, K, V]``
    (fp32) and window and writes neither (:func:`weaver_kernels.kda_tree_verify` after
    :func:`weaver_kernels.conv_tree` over the concatenated q/k/v); :meth:`commit` advances both along the accepted
    path from the pass's intermediates (``kda_tree_commit``: ``S* = Diag(e^{Γ_ℓ}) S0 + Σ (k_j ⊙ e^{Γ_ℓ − Γ_j}) u_jᵀ``,
    and ``conv_tree_commit``), never re-running the layer. Gates, output norm and projections as transformers'
    ``KimiLinearDeltaAttention`` computes them; the six projections of the layer input run as one GEMM.
    """

    def __init__(self, kda: torch.nn.Module, device, dtype):
        self.kda = kda
        self.num_heads, self.head_dim = kda.num_heads, kda.head_dim
        gate = kda.forget_gate
        self.in_proj = SharedInputLinears(kda.q_proj, kda.k_proj, kda.v_proj, gate.f_a_proj, kda.b_proj, kda.g_a_proj)
        self.norm = fused_norm(kda.o_norm, dtype)
        self.state = torch.zeros(1, kda.num_heads, kda.head_dim, kda.head_dim, device=device, dtype=torch.float32)
        self.window = torch.zeros(1, kda.conv_dim, kda.conv_kernel_size - 1, device=device, dtype=dtype)
        self.pending: tuple[torch.Tensor, ...] | None = None

    def _inputs(self, h: torch.Tensor):
        """``h [1, N, H]`` → conv input ``[1, N, 3·H·K]`` (q | k | v), the raw forget-gate projection f
        ``[1, N, H, K]`` and b ``[1, N, H]`` (the ops form g and β of them), and the output gate ``[1, N, H, K]``."""
        kda, N = self.kda, h.shape[1]
        q, k, v, f_a, b, g_a = self.in_proj(h)
        mixed = torch.cat([q, k, v], dim=-1)
        f = kda.forget_gate.f_b_proj(f_a).view(1, N, self.num_heads, self.head_dim)
        return mixed, f, b, kda.g_b_proj(g_a).view(1, N, self.num_heads, self.head_dim)

    def _heads(self, conv: torch.Tensor):
        return tuple(t.reshape(1, conv.shape[1], self.num_heads, self.head_dim) for t in conv.chunk(3, dim=-1))

    def _output(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.kda.o_proj(self.norm(o, gate).reshape(1, o.shape[1], -1))

    def _conv_args(self):
        conv = self.kda.conv1d
        return conv.weight.squeeze(1), conv.bias

    def forward_tree(self, h: torch.Tensor, tree_mask: torch.Tensor, parents: torch.Tensor,
                     max_depth: int | None = None) -> torch.Tensor:
        """``h [1, N, H]`` → layer output ``[1, N, H]`` of every node (``max_depth``: unused, the GDN layer's
        signature)."""
        kda = self.kda
        mixed, f, b, gate = self._inputs(h)
        conv = weaver_kernels.conv_tree(mixed, self.window, *self._conv_args(), parents, activation=kda.activation)
        q, k, v = self._heads(conv)
        o, u, gamma = weaver_kernels.kda_tree_verify(
            q, k, v, f, b, self.state, tree_mask, use_qk_l2norm_in_kernel=True, A_log=kda.forget_gate.A_log,
            dt_bias=kda.forget_gate.dt_bias)
        self.pending = (mixed, k, u, gamma)
        return self._output(o, gate)

    def forward_token(self, h: torch.Tensor) -> torch.Tensor:
        """One committed token ``h [1, 1, H]`` (the AR step): window and state advance in place, nothing pending."""
        kda = self.kda
        mixed, f, b, gate = self._inputs(h)
        conv = weaver_kernels.conv_decode(mixed, self.window, *self._conv_args(), activation=kda.activation)
        q, k, v = self._heads(conv)
        o = weaver_kernels.kda_decode(q, k, v, f, b, self.state, use_qk_l2norm_in_kernel=True,
                                      A_log=kda.forget_gate.A_log, dt_bias=kda.forget_gate.dt_bias)
        return self._output(o, gate)

    def commit(self, path: torch.Tensor):
        mixed, k, u, gamma = self.pending
        weaver_kernels.conv_tree_commit(self.window, mixed, path)
        weaver_kernels.kda_tree_commit(self.state, k, u, gamma, path, use_qk_l2norm_in_kernel=True)
        # `pending` stays: a captured commit is warmed up and recorded by calling it several times


class LatentAttentionLayerCache:
    """Committed compressed K/V of one multi-head latent attention layer (Kimi Linear's MLA, no RoPE), and tree
    attention over it.

    A cache row is what transformers' cache keeps for a token: the normed latent ``c`` (``kv_lora_rank``) and the key
    part shared by all heads ``k_r`` (``qk_rope_head_dim``; Kimi Linear rotates nothing), side by side as
    ``[c | k_r]`` in one ``[1, 1, max_length, R + r]`` buffer. Attention runs in the latent space, the up-projection
    ``kv_b_proj`` (per head ``W_k`` for the keys' nope part, ``W_v`` for the values) absorbed: query head h becomes
    ``[W_kᵀ q_nope | q_r]``, whose dot with a row is transformers' score ``q_nope · W_k c + q_r · k_r``; the row is also
    the value, and the first R entries of each head's output times ``W_v`` are its value mix. One K/V head for every
    query head (:func:`weaver_kernels.tree_attention` as MQA), so the cache stays compressed. Rows and commit as
    :class:`AttentionLayerCache`'s.
    """

    def __init__(self, attn: torch.nn.Module, config, max_length: int, device, dtype):
        if config.num_key_value_heads != config.num_attention_heads:
            raise ValueError(f"latent attention with {config.num_key_value_heads} K/V heads for "
                             f"{config.num_attention_heads} query heads: transformers expands one per query head")
        self.attn = attn
        self.num_heads = config.num_attention_heads
        self.nope, self.rope, self.rank = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.kv_lora_rank
        self.v_dim = attn.v_head_dim
        self.sliding_window = 0
        self.low_rank_q = attn.q_lora_rank is not None
        self.in_proj = SharedInputLinears(attn.q_a_proj if self.low_rank_q else attn.q_proj, attn.kv_a_proj_with_mqa)
        self.q_norm = fused_norm(attn.q_a_layernorm, dtype) if self.low_rank_q else None
        self.kv_norm = fused_norm(attn.kv_a_layernorm, dtype)
        self.latent = torch.zeros(1, 1, max_length, self.rank + self.rope, device=device, dtype=dtype)

    def forward_tree(self, h: torch.Tensor, rope, tree_mask: torch.Tensor, length: torch.Tensor, slots: torch.Tensor,
                     bound: int, depths: torch.Tensor, visible: torch.Tensor | None = None) -> torch.Tensor:
        """``h [1, N, H]`` → attention output ``[1, N, H]`` (arguments as :meth:`AttentionLayerCache.forward_tree`'s;
        ``rope`` is None: no rotation)."""
        attn, N, H = self.attn, h.shape[1], self.num_heads
        q, kv = self.in_proj(h)
        if self.low_rank_q:
            q = attn.q_b_proj(self.q_norm(q))
        q_nope, q_rope = q.reshape(N, H, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        c, k_rope = kv.split([self.rank, self.rope], dim=-1)
        row = torch.cat([self.kv_norm(c), k_rope], dim=-1)  # [1, N, R + r]
        self.latent.index_copy_(2, slots, row[:, None].to(self.latent.dtype))
        w = attn.kv_b_proj.weight.view(H, self.nope + self.v_dim, self.rank)
        q_latent = torch.einsum("nhd,hdr->hnr", q_nope, w[:, : self.nope])
        query = torch.cat([q_latent, q_rope.transpose(0, 1)], dim=-1)[None]  # [1, H, N, R + r]
        out = weaver_kernels.tree_attention(query, self.latent, self.latent, tree_mask, length, bound, attn.scaling,
                                            visible=visible)
        mixed = out.view(N, H, self.rank + self.rope)[..., : self.rank]
        o = torch.einsum("nhr,hvr->nhv", mixed, w[:, self.nope :])
        return attn.o_proj(o.reshape(1, N, H * self.v_dim))

    def commit(self, rows: torch.Tensor, dst: torch.Tensor):
        compact_rows((self.latent,), rows, dst)


# the layers whose committed state is a recurrent state and conv window (advanced along a path, not compacted)
RECURRENT_CACHES = (GatedDeltaNetLayerCache, KimiDeltaAttentionLayerCache)


class TargetAdapter:
    """A transformers causal LM seen as a tree verifier with committed caches (batch 1).

    Args:
        model: the target (``*ForCausalLM`` or ``Qwen3_5(Moe)ForConditionalGeneration``). Its values are never modified;
            the weights of linears that read one input are laid out as row blocks of one tensor
            (:class:`SharedInputLinears`).
        max_length: committed cache capacity in tokens (prompt + generated + one tree).
        feature_layer_ids: target layers whose outputs the drafter reads (DFlash ``target_layer_ids``).
        max_tree_depth: a bound on the depth of every tree it will verify, where the caller knows one (a block
            drafter's trees: block size − 1); Gated DeltaNet layers pick their verify kernel by it (a deeper tree is
            still verified exactly).
        options: how the step's kernels run (:class:`~modeling_weaver.options.StepOptions`; none changes a token).
    """

    def __init__(self, model, max_length: int, feature_layer_ids=(), max_tree_depth: int | None = None,
                 options: StepOptions = StepOptions()):
        config = text_config(model.config)
        model_type = getattr(model.config, "model_type", None)
        if model_type not in SUPPORTED:
            raise ValueError(
                f"modeling-weaver cannot verify trees on {type(model).__name__} (model_type {model_type!r}); "
                f"supported targets: {SUPPORTED_CLASSES}"
            )
        if getattr(config, "use_bidirectional_attention", False):  # (Gemma3 as an encoder: not a causal LM)
            raise ValueError(f"modeling-weaver cannot verify trees on {type(model).__name__} with bidirectional "
                             f"attention; supported targets: {SUPPORTED_CLASSES}")
        decoder = model.model
        if hasattr(decoder, "language_model"):  # Qwen3_5(Moe)ForConditionalGeneration
            decoder = decoder.language_model
        self.model, self.config, self.decoder = model, config, decoder
        self.hybrid = model_type in HYBRID_GDN
        rotary = getattr(decoder, "rotary_emb", None)  # (None: Kimi Linear rotates nothing)
        self.mrope = hasattr(rotary, "mrope_section")  # Qwen3.5 (+MoE); Qwen3-Next's RoPE is 1-D
        self.lm_head = model.get_output_embeddings()
        self.embed_tokens = model.get_input_embeddings()
        self.max_length = max_length
        self.max_tree_depth, self.options = max_tree_depth, options
        self.feature_layer_ids = list(feature_layer_ids)
        num_layers = len(decoder.layers)
        bad = [i for i in self.feature_layer_ids if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"feature layer ids {bad} are outside the target's {num_layers} layers")
        param = next(model.parameters())
        # Home: the input embedding's device, where the prompt and every tensor the loop reads live. A target that
        # accelerate's device_map split over devices runs each layer (and its cache) on that layer's own device.
        self.device, self.dtype = self.embed_tokens.weight.device, param.dtype
        self.layer_devices = [module_device(layer, self.device) for layer in decoder.layers]
        self.head_device = self.lm_head.weight.device
        self.norm_device = module_device(decoder.norm, self.device)
        self.devices = set(self.layer_devices) | {self.device, self.head_device, self.norm_device}
        before = weights_key(model)  # (the merges below may move weights)
        self.layer_caches = []
        for layer, device in zip(decoder.layers, self.layer_devices):
            attn = getattr(layer, "self_attn", None)
            if hasattr(layer, "linear_attn"):
                self.layer_caches.append(GatedDeltaNetLayerCache(layer.linear_attn, device, self.dtype, options))
            elif hasattr(attn, "forget_gate"):  # Kimi Linear keeps both of its layer kinds in `self_attn`
                self.layer_caches.append(KimiDeltaAttentionLayerCache(attn, device, self.dtype))
            elif hasattr(attn, "kv_a_proj_with_mqa"):
                self.layer_caches.append(LatentAttentionLayerCache(attn, config, max_length, device, self.dtype))
            else:
                self.layer_caches.append(AttentionLayerCache(attn, config, max_length, device, self.dtype))
        self.mlps = [mlp_forward(layer.mlp) for layer in decoder.layers]
        self.attention_windows = sorted({c.sliding_window for c in self.layer_caches
                                         if isinstance(c, (AttentionLayerCache, LatentAttentionLayerCache))})
        if any(d.type == "cuda" for d in self.devices) and before != weights_key(model):
            # the weights' old blocks are too small for the allocator to reuse: give them back (else a large target
            # keeps a large share of the device reserved that nothing uses)
            torch.cuda.empty_cache()
        self.layer_norms = [layer_norms(layer, self.dtype) for layer in decoder.layers]
        self.final_norm = fused_norm(decoder.norm, self.dtype)
        # Gemma3 rotates each layer type with its own RoPE base (one rotary call per type, not per layer)
        takes_type = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
        self.rope_types = list(config.layer_types) if takes_type else None
        self.decoder_rotary = rotary
        self.rotary_device = self.device if rotary is None else module_device(rotary, self.device)
        self.logit_softcap = getattr(config, "final_logit_softcapping", None)
        # Gated DeltaNet layers verify at most this many nodes at once on this device (None: no limit).
        self.max_tree_nodes = weaver_kernels.max_tree_nodes(self.device) if self.hybrid else None
        # What fixed-shape steps call for a tree pass and a commit (`compile_tree_step` swaps in compiled ones;
        # prefill, `verify` and `commit` stay eager: their sizes vary).
        self.tree_step, self.commit_step = self.forward_tree, self.commit_path
        self.token_step = self.forward_token
        self._root = torch.full((1,), -1, dtype=torch.long, device=self.device)
        self._one = torch.ones(1, 1, dtype=torch.bool, device=self.device)
        self.length = 0  # committed tokens (host mirror of ``length_t``)
        self.length_t = torch.zeros((), dtype=torch.long, device=self.device)
        self._pending_tree: Tree | None = None

    def reset(self) -> None:
        """Forget every committed token (a new generation reuses the buffers; K/V rows past 0 become scratch)."""
        self.length = 0
        self.length_t.zero_()
        for cache in self.layer_caches:
            if isinstance(cache, RECURRENT_CACHES):
                cache.state.zero_()
                cache.window.zero_()
                cache.pending = None
        self._pending_tree = None

    @torch.no_grad()
    def verify(self, tree: Tree, bound: int | None = None) -> TreeOutput:
        """One target pass over ``tree`` placed right after the committed tokens. Writes no committed state.

        Args:
            bound: attend over the first ``bound`` cache rows (default: the used ones, ``length + N``; a captured step
                passes ``max_length`` so that its shapes do not depend on the length).
        """
        n, N = self.length, len(tree)
        if n + N > self.max_length:
            raise ValueError(f"tree of {N} nodes after {n} tokens exceeds the cache capacity {self.max_length}")
        if self.max_tree_nodes is not None and N > self.max_tree_nodes:
            raise ValueError(f"a tree of {N} nodes exceeds the {self.max_tree_nodes} nodes the GDN tree kernel verifies "
                             f"at once on {self.device}")
        self._pending_tree = tree
        return self.forward_tree(tree.tokens, tree.parents, n + N if bound is None else bound, tree.ancestor_mask)

    def compile_tree_step(self) -> None:
        """Make :attr:`tree_step`, :attr:`commit_step` and :attr:`token_step` ``torch.compile``d
        :meth:`forward_tree`, :meth:`commit_path` and :meth:`forward_token` (whole graphs, static shapes: one compile
        each per tree size): inductor fuses the elementwise work between the matmuls, which a captured step
        otherwise runs as hundreds of small kernels."""
        self.tree_step, self.commit_step = compile_static(self.forward_tree), compile_static(self.commit_path)
        self.token_step = compile_static(self.forward_token)

    @torch.no_grad()
    def forward_tree(self, tokens: torch.Tensor, parents: torch.Tensor, bound: int,
                     tree_mask: torch.Tensor | None = None, advance: bool = False) -> TreeOutput:
        """The tensor work of :meth:`verify` (no checks, no host sync): what a captured step records.

        Args:
            tokens, parents: ``[N]`` the tree (see :class:`~modeling_weaver.tree.Tree`).
            bound: cache rows attended over (``>= length + N``).
            tree_mask: the tree's ancestor mask when the caller has it already (else built from ``parents``).
            advance: a one-node tree committed at once (:meth:`forward_token`): GDN layers advance their state and
                window in place; the K/V already sit in their committed row. ``length_t`` is left to the caller.
        """
        N = tokens.shape[0]
        if advance and N != 1:
            raise ValueError(f"advance takes a one-node tree, not {N} nodes")
        tree_mask = ancestor_mask_of(parents) if tree_mask is None else tree_mask
        depths = tree_mask.sum(dim=1) - 1
        positions = (self.length_t + depths)[None]  # committed length + depth
        if self.mrope:  # multimodal RoPE: the same text positions on its 3 grids (older transformers want them)
            positions = positions[None].expand(3, -1, -1)
        x = self.embed_tokens(tokens[None])
        if self.decoder_rotary is None:
            ropes = [None] * len(self.layer_caches)
        else:
            rx, rpos = x.to(self.rotary_device), positions.to(self.rotary_device)  # (no copies on one device)
            if self.rope_types is None:
                ropes = [self.decoder_rotary(rx, rpos)] * len(self.layer_caches)
            else:
                by_type = {t: self.decoder_rotary(rx, rpos, t) for t in dict.fromkeys(self.rope_types)}
                ropes = [by_type[t] for t in self.rope_types]
        slots = self.length_t + torch.arange(N, device=self.device)
        visible = self.attention_masks(tree_mask, bound, depths)
        features = {}
        hop = Hops() if len(self.devices) > 1 else _unmoved
        layers = zip(self.mlps, self.layer_caches, self.layer_norms, ropes, self.layer_devices)
        for i, (mlp, cache, (norm_in, norm_attn_out, norm_mlp_in, norm_mlp_out), rope, dev) in enumerate(layers):
            x = hop(x, dev)
            h = norm_in(x)
            if isinstance(cache, RECURRENT_CACHES):
                a = (cache.forward_token(h) if advance
                     else cache.forward_tree(h, hop(tree_mask, dev), hop(parents, dev), self.max_tree_depth))
            else:
                rope = None if rope is None else tuple(hop(t, dev) for t in rope)
                a = cache.forward_tree(h, rope, hop(tree_mask, dev), hop(self.length_t, dev), hop(slots, dev), bound,
                                       hop(depths, dev), hop(visible.get(cache.sliding_window), dev))
            x = x + (a if norm_attn_out is None else norm_attn_out(a))
            m = mlp(norm_mlp_in(x))
            x = x + (m if norm_mlp_out is None else norm_mlp_out(m))
            if i in self.feature_layer_ids:
                features[i] = x
        hidden = self.final_norm(hop(x, self.norm_device))
        if len(self.layer_caches) - 1 in features:
            # transformers' hidden_states[L] (what drafters are trained on) is the final-normed output
            features[len(self.layer_caches) - 1] = hidden
        feats = (torch.cat([hop(features[i], self.device) for i in self.feature_layer_ids], -1)[0] if features
                 else None)
        logits = self.lm_head(hop(hidden, self.head_device))[0]
        if self.logit_softcap is not None:  # (Gemma3ForCausalLM's, in its order of ops)
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return TreeOutput(logits=hop(logits, self.device), hidden=hop(hidden, self.device)[0], features=feats)

    def attention_masks(self, tree_mask: torch.Tensor, bound: int, depths: torch.Tensor) -> dict[int, torch.Tensor]:
        """The step's ``[N, bound]`` tree-attention masks, one per sliding window among the attention layers (0: full
        attention), for ``weaver_kernels.tree_attention``'s ``visible``: built once per step instead of once per
        layer. Empty on CUDA, whose kernel reads the tree mask itself."""
        if self.device.type == "cuda":
            return {}
        return {w: weaver_kernels.tree_attention_mask(tree_mask, self.length_t, bound, w, depths)
                for w in self.attention_windows}

    def forward_token(self, token: torch.Tensor, bound: int) -> TreeOutput:
        """One AR step, ``token [1]`` verified and committed at once (no host sync): the tree pass and commit of a
        one-node tree in one, with one-token GDN kernels. Outputs as :meth:`forward_tree`'s."""
        out = self.forward_tree(token, self._root, bound, self._one, advance=True)
        self.length_t += 1
        return out

    def commit(self, path, num_accepted: int | None = None) -> None:
        """Append the accepted nodes ``path`` (root..leaf of the last verified tree) to the committed caches.

        ``path`` may be right-padded with -1 to a fixed length (captured steps); then pass ``num_accepted`` to update
        the host mirror ``length`` without a sync, or leave it ``None`` to count on the device (one sync).
        """
        if self._pending_tree is None:
            raise RuntimeError("commit() must follow verify()")
        if num_accepted is None and not isinstance(path, torch.Tensor):
            num_accepted = sum(1 for node in path if node >= 0)
        path = torch.as_tensor(path, dtype=torch.long, device=self.device)
        count = self.commit_path(path)
        self.length += int(count) if num_accepted is None else num_accepted
        self._pending_tree = None

    def commit_path(self, path: torch.Tensor) -> torch.Tensor:
        """The tensor work of :meth:`commit` (no checks, no host sync); returns the number of accepted nodes."""
        count = (path >= 0).sum()
        rows = self.length_t + path.clamp(min=0)
        dst = self.length_t + torch.arange(path.shape[0], device=self.device)
        hop = Hops() if len(self.devices) > 1 else _unmoved
        for cache, dev in zip(self.layer_caches, self.layer_devices):
            if isinstance(cache, RECURRENT_CACHES):
                cache.commit(hop(path, dev))
            else:
                cache.commit(hop(rows, dev), hop(dst, dev))
        self.length_t += count
        return count

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, chunk_size: int = 128) -> TreeOutput:
        """Commit a prompt ``[T]`` in chains of ``chunk_size``; returns the outputs of every prompt position."""
        outs = []
        for start in range(0, input_ids.shape[0], chunk_size):
            chunk = input_ids[start : start + chunk_size]
            tree = Tree(chunk, torch.arange(-1, len(chunk) - 1, device=chunk.device), torch.zeros(len(chunk)),
                        check_root=False)  # a chain: its root is node 0 (no host read of it)
            outs.append(self.verify(tree))
            self.commit(torch.arange(len(chunk)), num_accepted=len(chunk))  # (no count read back from the device)
        # The last chunk's verify intermediates are committed and never read again; captured steps replay without
        # running Python, so left here they would stay alive through a whole generation (≈ 200 MB at 27B shape).
        for cache in self.layer_caches:
            if isinstance(cache, RECURRENT_CACHES):
                cache.pending = None
        cat = lambda xs: None if xs[0] is None else torch.cat(xs)  # noqa: E731
        return TreeOutput(*(cat([getattr(o, f) for o in outs]) for f in ("logits", "hidden", "features")))

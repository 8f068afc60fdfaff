"""The proposer seam (docs/DESIGN.md §1, §2, §4): draft one block with the DFlash drafter, then build the tree.

``Proposer.propose(bonus, context, n, last_hidden) → Proposal(hidden, logits, tree)``, with ``block_size`` and
``feature_layer_ids`` (which target features the drafter reads). Two implementations:

- :class:`EagerProposer`: a drafting runner (:class:`DFlashRunner`: the drafter with its KV cache of projected
  context) at each step's own shapes, then :func:`~modeling_weaver.tree.tree_drafts` (phases ``draft``, ``tree``);
- :class:`StaticProposer`: the same at fixed shapes, draft and tree build in one step (:class:`StaticDraft`: the
  drafter's context K/V in fixed buffers whose rows are positions; one CUDA graph per step on CUDA; phase
  ``draft+tree``).

Both project with the target's lm_head as :func:`draft_head` gives it (in the drafter's dtype, or int8).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F
import weaver_kernels

from ..options import StepOptions, TreePolicy
from ..target import compile_static
from ..tree import DEFAULT_POLICY, Tree, tree_drafts, with_root
from ..validation import is_int
from . import graphs


def untimed(phase: str):
    """The timer of an untimed step: every phase a no-op context."""
    return contextlib.nullcontext()


_WEIGHT_COPIES: dict = {}  # (id(weight), *what) → (weight version, weight weakref, the copy)


def copy_of(weight: torch.Tensor, what: tuple, make):
    """``make(weight)`` — a copy in another form (dtype, int8, gathered) — kept with the weight: made again after
    in-place updates of it, dropped with it (the cache holds the weight weakly: a copy never keeps a target alive)."""
    key = (id(weight), *what)
    cached = _WEIGHT_COPIES.get(key)
    if cached is None or cached[0] != weight._version or cached[1]() is not weight:
        if cached is None:
            weakref.finalize(weight, _WEIGHT_COPIES.pop, key, None)  # the copy goes with the weight
        with torch.no_grad():
            _WEIGHT_COPIES[key] = cached = (weight._version, weakref.ref(weight), make(weight))
    return cached[2]


_NODE_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Weaver → (weights' stamp, table)


def node_table_of(weaver, embed_weight: torch.Tensor) -> torch.Tensor:
    """``weaver.node_input_table(embed_weight)`` (a target's input embedding): a node's input as one row gather
    instead of a norm and a matmul per round. One table per Weaver, for the embedding it was last made for, shared by
    its proposers and generations; made again when the embedding or the Weaver's input layers change (in place or
    replaced)."""
    params = (embed_weight, *weaver.embed_norm.parameters(), *weaver.token_in.parameters())
    stamp = tuple((p.data_ptr(), p._version) for p in params)
    cached = _NODE_TABLES.get(weaver)
    if cached is None or cached[0] != stamp:
        _NODE_TABLES[weaver] = cached = (stamp, weaver.node_input_table(embed_weight))
    return cached[1]


class DraftHead:
    """The target's lm_head as a drafter projects with it: ``head(hidden [..., H]) → logits [..., V]`` in ``dtype``.

    Draft logits only shape the tree, never what is committed, so the drafter may read a cheaper copy of the weight
    than the target's: in its own ``dtype`` (a bf16 drafter of an fp32 target: on CPUs with bf16 matmuls that halves
    the drafting cost), or with ``int8`` int8 rows with one scale each through ``weaver_kernels.int8_linear``: half of
    bf16's bytes for the draft's largest read, at a small error on the logits (an e4m3 copy was tried: larger error,
    less acceptance, and slower; BENCHMARKS.md); on a CPU, fbgemm's int8 GEMM (``weaver_kernels.
    cpu_int8_linear``: a quarter of fp32's bytes, each row's activations rounded too, on a grid of its own, so a
    depth's logits do not depend on how many depths are projected; compiled steps, which cannot trace it, take the
    reference).
    ``weight`` is the target's own weight, held weakly: a cached copy must not keep the target alive. ``module``: the
    lm_head itself, called when no copy is needed (so a drafter projects as the target does: through its packed CPU
    weight inside a generation, ``StepOptions.packed_linears``).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, int8: bool = False,
                 module: torch.nn.Module | None = None):
        self._weight, self.dtype, self.int8, self.module = weakref.ref(weight), dtype, int8, module
        self.device = weight.device
        cast = (lambda t: t if t is None or t.dtype == dtype else t.detach().to(dtype))
        self.cast_bias = cast(bias)
        self.cast_weight = None if int8 else cast(weight)
        self.quantised, self.scale = weaver_kernels.quantize_rows(weight) if int8 else (None, None)
        self.cpu_packed = (weaver_kernels.cpu_int8_pack(self.quantised, self.scale, bias)
                           if int8 and weight.device.type == "cpu" and weaver_kernels.cpu_int8_available() else None)

    @property
    def weight(self) -> torch.Tensor | None:
        return self._weight()

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.device != self.device:  # (a drafter beside a target split over devices: the head's device and back)
            return self(hidden.to(self.device)).to(hidden.device)
        if self.module is not None:
            return self.module(hidden.to(self.dtype))
        if not self.int8:
            return F.linear(hidden.to(self.dtype), self.cast_weight, self.cast_bias)
        if self.cpu_packed is not None and hidden.device.type == "cpu" and not torch.compiler.is_compiling():
            return weaver_kernels.cpu_int8_linear(hidden.to(self.dtype), self.cpu_packed)
        return weaver_kernels.int8_linear(hidden.to(self.dtype), self.quantised, self.scale, self.cast_bias)


def draft_head(target, dtype: torch.dtype, int8: bool | None = None, local: bool = False) -> DraftHead:
    """The :class:`DraftHead` of ``target`` for a drafter in ``dtype`` (``int8``: see
    :attr:`~modeling_weaver.options.StepOptions.int8_head`; None: on CUDA). A copy of the weight (another dtype, or
    int8) is cached with the weight: made again after in-place updates of it, dropped with it. A DTensor weight (a
    tensor-parallel target) is applied by its module, every rank together; ``local``: from its gathered copy
    (:func:`full_weight`), by this rank alone."""
    head = target.get_output_embeddings()
    weight, bias = head.weight, head.bias
    if type(weight.data) is not torch.Tensor and local:
        weight, bias = full_weight(weight), None if bias is None else full_weight(bias)
    int8 = StepOptions(int8_head=int8).int8_head_on(weight.device)
    if not int8 and weight.dtype == dtype:  # the weight itself: nothing to cache
        return DraftHead(weight, bias, dtype, module=None if weight is not head.weight else head)
    if type(weight.data) is not torch.Tensor:
        # a tensor-subclass weight (a DTensor of a tensor-parallel target, a quantized one) is applied by its module,
        # in its own dtype: no copy of it is made
        return DraftHead(weight, bias, weight.dtype, module=head)
    return copy_of(weight, (dtype, int8), lambda w: DraftHead(w, bias, dtype, int8))


def full_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as a plain tensor the Weaver can gather rows of: itself, or for a DTensor (a tensor-parallel
    target's lm_head or embedding, split over the ranks) its whole value, gathered once and kept with the weight (one
    replicated copy per rank; a collective, which every rank's identical loop reaches in the same order)."""
    if type(weight.data) is torch.Tensor:
        return weight
    return copy_of(weight, ("full",), lambda w: w.detach().full_tensor())


def local_embedding(embed_tokens: torch.nn.Module) -> torch.nn.Module:
    """``embed_tokens`` that this rank calls alone: itself, or for a DTensor weight (whose forward is a collective)
    an embedding of its gathered copy (:func:`full_weight`, shared, not copied again)."""
    weight = embed_tokens.weight
    if type(weight.data) is torch.Tensor:
        return embed_tokens
    return torch.nn.Embedding.from_pretrained(full_weight(weight), freeze=True)


def embedding_on(embed_tokens: torch.nn.Module, device: torch.device):
    """``embed_tokens`` called from ``device``: itself where it lives there, else a callable that sends the ids to
    its device and the embeddings back (a drafter or Weaver beside a target that device_map split over devices)."""
    home = embed_tokens.weight.device
    if home == device:
        return embed_tokens
    return lambda ids: embed_tokens(ids.to(home)).to(device)


class DFlashRunner:
    """Drives a DFlash drafter across steps: its KV cache of projected context, block inputs and the target's lm_head.

    Any object with the same ``draft`` method, ``block_size`` and ``feature_layer_ids`` can stand in for it in an
    :class:`EagerProposer` (tests plant drafts through this seam; a stand-in may return logits for more depths than
    ``depths`` asks for).
    """

    def __init__(self, drafter, target, options: StepOptions = StepOptions(), local: bool = False):
        self.drafter = drafter
        # local: this rank drafts alone (StepOptions.tp_drafter="rank0"), so no call of the target's may be a collective
        self.embed_tokens = (local_embedding if local else (lambda e: e))(target.get_input_embeddings())
        self.block_size = drafter.config.block_size
        self.feature_layer_ids = list(drafter.config.target_layer_ids)
        param = next(drafter.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.head = draft_head(target, self.dtype, options.int8_head, local=local)
        self.options = options
        self.cache = drafter.new_cache()
        self.embed = embedding_on(self.embed_tokens, self.device)

    def draft(self, bonus: int, context: torch.Tensor, n: int, depths: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One block ``[bonus, MASK…]`` at positions ``n..n+B-1``, reading ``context [C, n_layers·H]``: the target
        features of the positions ``n-C..n-1`` not yet in the drafter's cache. Returns the drafter's hidden states
        and marginal logits for depths ``1..B-1`` (``[B-1, H]``, ``[B-1, V]``); logits for the first ``depths``
        depths only when given (a tree of budget b uses no deeper ones: the lm_head is most of a draft's cost)."""
        device = self.device
        block = self.drafter.block_embeddings(torch.tensor([bonus], device=device), self.embed).to(self.dtype)
        position_ids = torch.arange(n - context.shape[0], n + self.block_size, device=device)[None]
        hidden = self.drafter(
            noise_embedding=block, target_hidden=context[None].to(device, self.dtype), position_ids=position_ids,
            past_key_values=self.cache, use_cache=True,
        )[0, 1:]
        self.drafter.crop_cache(self.cache, n)  # block K/V never persist
        return hidden, self.head(hidden if depths is None else hidden[:depths])


class Proposal(NamedTuple):
    """One step's proposal: the drafter's hidden states and marginal logits for depths ``1..B-1`` and the tree."""

    hidden: torch.Tensor
    logits: torch.Tensor
    tree: Tree


class Proposer:
    """Draft + tree build for one mode and budget: :meth:`propose` gives the step's :class:`Proposal`, timing its
    phases with ``timed(phase)``. ``block_size`` and ``feature_layer_ids`` come from the drafter; ``resizable``:
    whether a step may ask for a smaller tree than the budget (``propose(..., budget=)``)."""

    block_size: int
    feature_layer_ids: list[int]
    budget: int

    @property
    def resizable(self) -> bool:
        return False

    def propose(self, bonus: int, context: torch.Tensor, n: int, last_hidden: torch.Tensor,
                timed=untimed, budget: int | None = None) -> Proposal:
        """The tree rooted at ``bonus`` (position ``n``), after the new ``context`` (target features of positions
        ``n-C..n-1``); ``last_hidden``: the target's final hidden state at ``n-1`` (Weaver's prompt); ``budget``:
        this step's drafts, at most the proposer's own (None: its own; only where ``resizable``)."""
        raise NotImplementedError

    def _budget(self, budget: int | None) -> int:
        """This step's drafts: ``budget`` checked against the proposer's own (None: its own)."""
        own = self.budget
        if budget is None or budget == own:
            return own
        if not self.resizable or not is_int(budget) or not 0 < budget <= own:
            raise ValueError(f"this proposer builds {own} drafts a step; a step's budget must be "
                             f"{'1..' if self.resizable else ''}{own}, got {budget!r}")
        return budget


class EagerProposer(Proposer):
    """A drafting ``runner`` (:class:`DFlashRunner` or a stand-in) at each step's own shapes, then the tree of
    ``mode`` built from its drafts (phases ``draft`` and ``tree``); a step may ask for fewer drafts."""

    @property
    def resizable(self) -> bool:
        return True

    def __init__(self, runner, mode: str, budget: int, weaver, target, policy: TreePolicy = DEFAULT_POLICY,
                 local: bool = False):
        self.runner, self.mode, self.budget, self.policy = runner, mode, budget, policy
        self.weaver = weaver if mode == "weaver" else None
        self.embed_tokens = (local_embedding if local else (lambda e: e))(target.get_input_embeddings())
        # the Weaver gathers lm_head rows: of a DTensor, from a copy gathered here once, on every rank together
        self.lm_head_weight = full_weight(target.get_output_embeddings().weight) if mode == "weaver" else None
        self.block_size, self.feature_layer_ids = runner.block_size, runner.feature_layer_ids
        self.home = self.embed_tokens.weight.device  # (the target's tokens: where the tree is verified)

    @functools.cached_property
    def node_table(self) -> torch.Tensor | None:
        """The Weaver's node-input table (:func:`node_table_of`), where the runner's options ask for it (a stand-in
        runner without options: the defaults); made at the first proposal, so a rank that never proposes (tensor
        parallelism, ``tp_drafter="rank0"``) holds none."""
        if self.weaver is None or not getattr(self.runner, "options", StepOptions()).node_table:
            return None
        return node_table_of(self.weaver, full_weight(self.embed_tokens.weight))

    def propose(self, bonus: int, context: torch.Tensor, n: int, last_hidden: torch.Tensor,
                timed=untimed, budget: int | None = None) -> Proposal:
        budget = self._budget(budget)
        with timed("draft"):
            hidden, logits = self.runner.draft(bonus, context, n, depths=budget)
        with timed("tree"):
            # built where the drafter put its drafts (the Weaver sits with the drafter), verified at home
            tree = with_root(bonus, tree_drafts(self.mode, bonus, hidden, logits, budget, self.weaver,
                                                last_hidden.to(hidden.device),
                                                embedding_on(self.embed_tokens, hidden.device),
                                                self.lm_head_weight, self.node_table, policy=self.policy))
        return Proposal(hidden, logits, tree.to(self.home))


class RankZeroProposer(Proposer):
    """``StepOptions.tp_drafter="rank0"`` on a tensor-parallel target: rank 0 proposes with the proposer it wraps
    (built ``local``: it calls nothing of the target's that is a collective) and broadcasts the tree (its size, then
    tokens and parents, then ``logq``); the other ranks receive it on ``device`` (their own GPU under NCCL, the CPU
    under gloo), and their drafters never run (their proposals hold the tree alone: no hidden states, no logits)."""

    def __init__(self, inner: Proposer, device: torch.device):
        import torch.distributed as dist

        self.inner, self.device, self.dist = inner, device, dist
        self.block_size, self.feature_layer_ids = inner.block_size, inner.feature_layer_ids

    @property
    def resizable(self) -> bool:
        return self.inner.resizable

    def propose(self, bonus: int, context: torch.Tensor, n: int, last_hidden: torch.Tensor,
                timed=untimed, budget: int | None = None) -> Proposal:
        dist, first = self.dist, self.dist.get_rank() == 0
        proposal = self.inner.propose(bonus, context, n, last_hidden, timed, budget=budget) if first else None
        with timed("tree"):
            size = torch.tensor([len(proposal.tree) if first else 0], device=self.device)
            dist.broadcast(size, 0)
            ids = (torch.stack([proposal.tree.tokens, proposal.tree.parents]).to(self.device) if first
                   else torch.empty(2, int(size), dtype=torch.long, device=self.device))
            logq = (proposal.tree.logq.to(self.device, torch.float32) if first
                    else torch.empty(int(size), device=self.device))
            dist.broadcast(ids, 0)
            dist.broadcast(logq, 0)
        return proposal if first else Proposal(None, None, Tree(ids[0], ids[1], logq, check_root=False))


class DFlashStaticCache:
    """Context K/V of a DFlash drafter in fixed ``[1, kv_heads, rows, head_dim]`` buffers; row = position.

    ``update`` (called by each attention layer) writes the call's K/V at ``slots`` and returns the whole buffers;
    ``query_key_positions`` tells the layers where queries and keys sit (sliding / causal layer masks); ``attend``
    runs a layer's attention with :func:`weaver_kernels.tree_attention`, whose cost follows the rows in use, not the
    whole buffer as masked SDPA's does. :class:`StaticDraft` hands ``attend`` and ``query_key_positions`` to the
    drafter as arguments.
    """

    def __init__(self, drafter, rows: int, slots: int, device, dtype):
        config = drafter.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (1, config.num_key_value_heads, rows, head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in drafter.layers]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in drafter.layers]
        self.slots = torch.zeros(slots, dtype=torch.long, device=device)
        self.block_size = size = drafter.block_size
        self.query_key_positions = (torch.zeros(size, dtype=torch.long, device=device),
                                    torch.arange(rows, device=device))
        self.length = torch.zeros((), dtype=torch.long, device=device)  # the block's first row (= position)
        self.block_masks = {False: torch.ones(size, size, dtype=torch.bool, device=device),
                            True: torch.ones(size, size, dtype=torch.bool, device=device).tril()}

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int):
        self.keys[layer_idx].index_copy_(2, self.slots, keys.to(self.keys[layer_idx].dtype))
        self.values[layer_idx].index_copy_(2, self.slots, values.to(self.values[layer_idx].dtype))
        return self.keys[layer_idx], self.values[layer_idx]

    def kernel_attends(self, attn) -> bool:
        """Whether :meth:`attend` takes this layer: all but a sliding window shorter than the block around a
        non-causal block (it would hide later block rows too; masked SDPA does those)."""
        window = attn.sliding_window or 0
        return not (window and not attn.causal_in_block and window < self.block_size)

    def attend(self, attn, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor | None:
        """``[1, S, heads · head_dim]``: the block's queries ``q [1, heads, S, head_dim]`` at rows ``length..``
        over every row before the block and the block's own rows (causal ones for a causal-in-block layer), within
        the layer's sliding window — the visibility :class:`StaticDraft`'s mask describes, which this replaces (the
        layer's ``attention_mask`` is not read). None where :meth:`kernel_attends` says no."""
        if q.shape[2] != self.block_size or not self.kernel_attends(attn):
            return None
        return weaver_kernels.tree_attention(q, keys, values, self.block_masks[attn.causal_in_block], self.length,
                                             keys.shape[2], attn.scaling, attn.sliding_window or 0)


class StaticDraft:
    """:class:`DFlashRunner` at fixed shapes (CUDA graph on CUDA); same ``draft`` contract.

    Each call drafts one block after ``block_size`` context rows (the accepted path; padding rows go past the block,
    where the mask never looks). A longer context — the prompt, once — has its leading rows written by one eager
    drafter call first (:meth:`_lead`), then its last ``≤ block_size`` rows go with the block as usual.

    Args:
        drafter: a :class:`~modeling_weaver.modeling_dflash.DFlashDraftModel`; target: its target (embedding, lm_head).
        max_length: positions the generation may reach.
        options: :class:`~modeling_weaver.options.StepOptions` (the int8 head, node tables).
    """

    def __init__(self, drafter, target, max_length: int, capture: bool | None = None,
                 options: StepOptions = StepOptions()):
        self.drafter, self.options = drafter, options
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()  # the target's (Weaver gathers its rows)
        self.block_size = drafter.config.block_size
        self.feature_layer_ids = list(drafter.config.target_layer_ids)
        param = next(drafter.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.head = draft_head(target, self.dtype, options.int8_head)
        size = self.block_size
        self.rows = max_length + 2 * size  # pads sit after the block
        self.cache = DFlashStaticCache(drafter, self.rows, 2 * size, self.device, self.dtype)
        self.context = torch.zeros(size, drafter.fc.in_features, device=self.device, dtype=self.dtype)
        self.count = torch.zeros((), dtype=torch.long, device=self.device)  # real context rows
        self.n = self.cache.length  # position of the block's first token (the cache's attention reads it)
        # drafter code that takes the cache's attention and row positions as arguments (an older remote-code copy
        # reads them from the cache itself, and never hands it its attention)
        takes = all(getattr(layer.self_attn, "cache_attends", False) for layer in drafter.layers)
        self.cache_kwargs = dict(attend=self.cache.attend,
                                 query_key_positions=self.cache.query_key_positions) if takes else {}
        # the additive mask is only for layers the cache's kernel does not take
        self.mask_needed = not (takes and all(self.cache.kernel_attends(layer.self_attn) for layer in drafter.layers))
        self.bonus = torch.zeros(1, dtype=torch.long, device=self.device)
        self._graphs: dict = {}
        self._steps: dict = {}  # proposers, fused steps and node tables on this drafter (graphs read their buffers)

    def _forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        size, device = self.block_size, self.device
        idx = torch.arange(size, device=device)
        context_rows = torch.where(idx < self.count, self.n - self.count + idx, self.n + size + idx)
        block_rows = self.n + idx
        rows = torch.cat([context_rows, block_rows])
        self.cache.slots.copy_(rows)
        self.cache.query_key_positions[0].copy_(block_rows)
        visible = (torch.arange(self.rows, device=device) < self.n + size).expand(1, 1, size, -1) \
            if self.mask_needed else None
        block = self.drafter.block_embeddings(self.bonus, self.embed_tokens).to(self.dtype)
        hidden = self.drafter(noise_embedding=block, target_hidden=self.context[None], position_ids=rows[None],
                              past_key_values=self.cache, attention_mask=visible, **self.cache_kwargs)[0, 1:]
        return hidden, self.head(hidden)

    def load(self, bonus: int, context: torch.Tensor, n: int) -> None:
        """Put the inputs of the last (or only) block-size chunk of ``context`` in the static buffers, after writing
        the K/V of any rows before it."""
        size = self.block_size
        if n + 2 * size > self.rows:
            raise ValueError(f"position {n} is beyond this drafter cache ({self.rows - 2 * size} positions)")
        first = n - context.shape[0]
        lead = (context.shape[0] - 1) // size * size  # rows before the last (or only) chunk
        self.bonus.fill_(int(bonus))
        if lead > 0:
            self._lead(context[:lead], first)
        chunk = context[lead:]
        self.context[: chunk.shape[0]].copy_(chunk)
        self.count.fill_(chunk.shape[0])
        self.n.fill_(n)

    @torch.no_grad()
    def _lead(self, context: torch.Tensor, first: int) -> None:
        """Context K/V of positions ``first..first+C-1`` in one eager drafter call (the prompt, once per generation):
        one read of the drafter's weights, not one per block-size chunk. The block rides along after the context, in
        rows the next chunk overwrites; its hidden states are not needed (no lm_head)."""
        size, n = self.block_size, first + context.shape[0]
        rows = torch.arange(first, n + size, device=self.device)
        graph_slots, graph_length = self.cache.slots, self.cache.length  # the graphs' buffers: swapped back below
        self.cache.slots, self.cache.length = rows, torch.tensor(n, device=self.device)
        try:
            self.cache.query_key_positions[0].copy_(rows[-size:])
            visible = (torch.arange(self.rows, device=self.device) < n + size).expand(1, 1, size, -1)
            block = self.drafter.block_embeddings(self.bonus, self.embed_tokens).to(self.dtype)
            self.drafter(noise_embedding=block, target_hidden=context[None].to(self.dtype), position_ids=rows[None],
                         past_key_values=self.cache, attention_mask=visible, **self.cache_kwargs)
        finally:
            self.cache.slots, self.cache.length = graph_slots, graph_length

    def run(self, fn, key="draft"):
        """``fn()`` — replayed from a CUDA graph captured on first use (one per ``key``) when capturing."""
        if not self.capture:
            return fn()
        if key not in self._graphs:
            self._graphs[key] = graphs.capture_graph(fn)
        graph, out = self._graphs[key]
        graph.replay()
        return out

    def node_table(self, weaver) -> torch.Tensor:
        """:func:`node_table_of` this target's embedding (its proposers share it)."""
        return node_table_of(weaver, full_weight(self.embed_tokens.weight))

    def proposer(self, mode: str, budget: int, weaver=None, shape_logits=None, compile: bool = False,
                 policy: TreePolicy = DEFAULT_POLICY) -> StaticProposer:
        """The :class:`StaticProposer` of this drafter for ``mode``, ``budget`` and ``policy`` (kept: its graph
        reads its buffers); ``compile``: its tree build ``torch.compile``d."""
        key = StaticProposer.key_of(mode, budget, weaver, shape_logits, compile, policy)
        if key not in self._steps:
            self._steps[key] = StaticProposer(self, mode, budget, weaver, shape_logits, compile, policy)
        return self._steps[key]

    @torch.no_grad()
    def draft(self, bonus: int, context: torch.Tensor, n: int, depths: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`DFlashRunner.draft`: block ``[bonus, MASK…]`` at ``n..``, new ``context`` of ``n-C..n-1``
        (logits for every depth: the shapes are fixed, ``depths`` is only what the caller needs)."""
        self.load(bonus, context, n)
        return self.run(self._forward)


class StaticProposer(Proposer):
    """Draft and tree build of one mode and budget at fixed shapes: one CUDA graph per step on CUDA (phase
    ``draft+tree``).

    ``propose`` returns the drafter's hidden states and logits (as :meth:`StaticDraft.draft`) and the tree, built on
    the device by :func:`~modeling_weaver.tree.tree_drafts`.
    ``shape_logits`` (device ops only) may transform the draft logits first — the acceptance replay plants peaks.
    Weaver trees follow ``policy`` and, with the drafter's ``options.node_table``, gather node inputs from the
    Weaver's node-input table (one per drafter and Weaver, shared by its proposers) instead of a norm and matmul per
    round.
    """

    def __init__(self, draft: StaticDraft, mode: str, budget: int, weaver=None, shape_logits=None,
                 compile: bool = False, policy: TreePolicy = DEFAULT_POLICY):
        if mode == "weaver" and weaver is None:
            raise ValueError("the weaver mode needs a Weaver")
        self.draft, self.mode, self.budget, self.weaver, self.policy = draft, mode, budget, weaver, policy
        self.shape_logits = shape_logits
        # Drafting and the tree build are hundreds of small ops (the drafter's layers between its matmuls, a Weaver
        # node step per expansion round): compiled, inductor fuses them (whole graph, the rounds unrolled; one
        # compile per proposer).
        self.node_table = draft.node_table(weaver) if mode == "weaver" and draft.options.node_table else None
        self.key = self.key_of(mode, budget, weaver, shape_logits, compile, policy)  # of this proposer's graph too
        self._forward = compile_static(self._draft_and_tree) if compile else self._draft_and_tree
        self.feature_layer_ids, self.block_size = draft.feature_layer_ids, draft.block_size
        self.lm_head_weight = full_weight(draft.lm_head.weight)  # (gathered before any capture)
        self.last_hidden = torch.zeros(draft.lm_head.weight.shape[1], device=draft.device,
                                       dtype=draft.lm_head.weight.dtype)

    @staticmethod
    def key_of(mode, budget, weaver, shape_logits, compile, policy: TreePolicy) -> tuple:
        # (the drafter's options are its own cache key; only Weaver trees read a policy)
        return (mode, budget, id(weaver), id(shape_logits), compile, policy if mode == "weaver" else None)

    def _draft_and_tree(self):
        hidden, logits = self.draft._forward()
        if self.shape_logits is not None:
            logits = self.shape_logits(logits)
        drafts = tree_drafts(self.mode, self.draft.bonus[0], hidden, logits, self.budget, self.weaver,
                             self.last_hidden, self.draft.embed_tokens, self.lm_head_weight, self.node_table,
                             self.policy)
        return hidden, logits, drafts

    @torch.no_grad()
    def propose(self, bonus: int, context: torch.Tensor, n: int, last_hidden: torch.Tensor,
                timed=untimed, budget: int | None = None) -> Proposal:
        self._budget(budget)  # (fixed shapes: its own budget only)
        with timed("draft+tree"):
            self.draft.load(bonus, context, n)
            self.last_hidden.copy_(last_hidden)
            hidden, logits, drafts = self.draft.run(self._forward, key=self.key)
            return Proposal(hidden, logits, with_root(self.draft.bonus, drafts))  # (the root on the device: no copy)

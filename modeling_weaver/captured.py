"""Fixed-shape decoding steps, captured in CUDA graphs (issue 5).

:class:`StaticTarget` wraps a :class:`~modeling_weaver.target.TargetAdapter` for one tree size: every verify pads the
tree to ``num_nodes`` and attends over the whole cache (``bound = max_length``), every commit takes the accepted path
right-padded with -1 to ``num_nodes``. Inputs go through static buffers, and the committed length is read from the
adapter's device tensor, so nothing in either step depends on the prompt or the position: on CUDA each step is one
CUDA graph, captured once and replayed for any prompt length up to ``max_length``. Elsewhere (or with
``capture=False``) the same static-buffer code runs eagerly — what the CPU tests exercise (also with graph semantics).

:class:`StaticDraft` does the same for the DFlash drafter: its context K/V live in fixed buffers whose rows are
positions, each step's new context (one accepted path, at most a block) is padded to the block size, and attention
runs over the whole buffer with a mask. :class:`StaticProposer` adds the device tree build of one mode and budget.
:class:`FusedGreedyStep` makes a whole greedy step — draft + tree, verify, acceptance, commit — one graph.

One :class:`StaticTarget` per tree size; a generation uses one size throughout (the commit graph reads the outputs of
its own verify graph). Prefill stays eager (chunked, once per prompt). :func:`static_target` and :func:`static_draft`
keep the steps per model, cache capacity (rounded up to a power of two) and tree size, so later generations replay
the same graphs. :func:`draft_head` gives a drafter the target's lm_head in its own dtype (or int8).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
import weaver_kernels

from .accept import accept_greedy_tensors
from .options import StepOptions, TreePolicy
from .target import TargetAdapter, TreeOutput, compile_static, weights_key
from .tree import DEFAULT_POLICY, Tree, ancestor_mask_of, rooted, tree_drafts, with_root


def capture_graph(fn, pool=None, warmup: int = 2, restore=()):
    """Run ``fn`` ``warmup`` times on a side stream (kernel compilation, autotuning, cuBLAS workspaces), then capture
    one call in a CUDA graph. Returns ``(graph, output of the captured call)``.

    ``restore``: tensors ``fn`` advances in place (a step counter, committed state); the warm-ups' changes to them are
    undone, so the first replay starts where the caller left off.
    """
    saved = [x.clone() for x in restore]
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
    finally:  # also when capture fails and the caller goes on eagerly
        for x, y in zip(restore, saved):
            x.copy_(y)
    return graph, out


class StaticTarget:
    """A :class:`TargetAdapter` seen through fixed-shape verify/commit steps (CUDA graphs on CUDA).

    Same interface as the adapter for the decoding loop: ``prefill``, ``verify``, ``commit``, ``length``,
    ``max_length``, ``device``, ``max_tree_nodes``.

    Args:
        adapter: the target adapter (its caches are the ones written).
        num_nodes: tree size of every step (budget + 1 for the root); smaller trees are padded.
        capture: capture CUDA graphs (default: when the adapter is on CUDA).
    """

    def __init__(self, adapter: TargetAdapter, num_nodes: int, capture: bool | None = None):
        if adapter.max_tree_nodes is not None and num_nodes > adapter.max_tree_nodes:
            raise ValueError(f"{num_nodes} nodes exceed the {adapter.max_tree_nodes} the GDN tree kernel verifies")
        self.adapter, self.num_nodes = adapter, num_nodes
        self.capture = adapter.device.type == "cuda" if capture is None else capture
        device = adapter.device
        self.tokens = torch.zeros(num_nodes, dtype=torch.long, device=device)
        self.parents = torch.full((num_nodes,), -1, dtype=torch.long, device=device)
        self.path = torch.full((num_nodes,), -1, dtype=torch.long, device=device)
        self._graphs: tuple | None = None  # (verify graph, its output, commit graph)
        self.captures = 0
        self._ar: FusedARStep | None = None

    def ar_step(self) -> FusedARStep:
        """This step's :class:`FusedARStep` (one-node steps only; kept: its graph reads these buffers)."""
        if self._ar is None:
            self._ar = FusedARStep(self)
        return self._ar

    # The adapter's bookkeeping, for the loop.
    length = property(lambda self: self.adapter.length)
    max_length = property(lambda self: self.adapter.max_length)
    device = property(lambda self: self.adapter.device)
    max_tree_nodes = property(lambda self: self.adapter.max_tree_nodes)

    def prefill(self, input_ids: torch.Tensor, chunk_size: int = 128) -> TreeOutput:
        return self.adapter.prefill(input_ids, chunk_size)

    def _verify(self) -> TreeOutput:
        # (the mask passed in, as the fused step does: one signature, one compile, when the tree step is compiled)
        return self.adapter.tree_step(self.tokens, self.parents, self.adapter.max_length, ancestor_mask_of(self.parents))

    def _commit(self) -> None:
        self.adapter.commit_step(self.path)

    @torch.no_grad()
    def verify(self, tree: Tree) -> TreeOutput:
        """Verify ``tree`` (at most ``num_nodes`` nodes); outputs for its real nodes (views of static buffers, valid
        until the next verify)."""
        n, size = self.adapter.length, len(tree)
        if size > self.num_nodes:
            raise ValueError(f"a tree of {size} nodes does not fit this {self.num_nodes}-node step")
        if n + self.num_nodes > self.adapter.max_length:
            raise ValueError(f"a {self.num_nodes}-node step after {n} tokens exceeds the cache capacity "
                             f"{self.adapter.max_length}")
        padded = tree.padded(self.num_nodes)
        self.tokens.copy_(padded.tokens)
        self.parents.copy_(padded.parents)
        if not self.capture:
            out = self._verify()
        else:
            if self._graphs is None:
                self._capture()
            self._graphs[0].replay()
            out = self._graphs[1]
        self.adapter._pending_tree = tree
        cut = lambda t: None if t is None else t[:size]  # noqa: E731
        return TreeOutput(cut(out.logits), cut(out.hidden), cut(out.features))

    @torch.no_grad()
    def commit(self, path) -> None:
        """Commit the accepted ``path`` (root..leaf node indices of the last verified tree)."""
        if self.adapter._pending_tree is None:
            raise RuntimeError("commit() must follow verify()")
        path = list(path)
        self.path.fill_(-1)
        self.path[: len(path)].copy_(torch.tensor(path, dtype=torch.long))
        if self.capture:
            self._graphs[2].replay()
        else:
            self._commit()
        self.adapter.length += len(path)
        self.adapter._pending_tree = None

    def _capture(self):
        # Warm-ups write only scratch rows (verify) or nothing (an all -1 path commits no node).
        self.path.fill_(-1)
        verify_graph, out = capture_graph(self._verify)
        commit_graph, _ = capture_graph(self._commit, pool=verify_graph.pool())
        self._graphs = (verify_graph, out, commit_graph)
        self.captures += 1


_DRAFT_HEADS: dict = {}  # (id(weight), dtype, int8) → (weight version, DraftHead)


class DraftHead:
    """The target's lm_head as a drafter projects with it: ``head(hidden [..., H]) → logits [..., V]`` in ``dtype``.

    Draft logits only shape the tree, never what is committed, so the drafter may read a cheaper copy of the weight
    than the target's: in its own ``dtype`` (a bf16 drafter of an fp32 target: on CPUs with bf16 matmuls that halves
    the drafting cost), or with ``int8`` int8 rows with one scale each through ``weaver_kernels.int8_linear``: half of
    bf16's bytes for the draft's largest read, at a small error on the logits (an e4m3 copy was tried: larger error,
    less acceptance, and slower; BENCHMARKS.md).
    ``weight`` is the target's own weight, held weakly: a cached copy must not keep the target alive.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, int8: bool = False):
        self._weight, self.dtype, self.int8 = weakref.ref(weight), dtype, int8
        cast = (lambda t: t if t is None or t.dtype == dtype else t.detach().to(dtype))
        self.cast_bias = cast(bias)
        self.cast_weight = None if int8 else cast(weight)
        self.quantised, self.scale = weaver_kernels.quantize_rows(weight) if int8 else (None, None)

    @property
    def weight(self) -> torch.Tensor | None:
        return self._weight()

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.int8:
            return F.linear(hidden.to(self.dtype), self.cast_weight, self.cast_bias)
        return weaver_kernels.int8_linear(hidden.to(self.dtype), self.quantised, self.scale, self.cast_bias)


def draft_head(target, dtype: torch.dtype, int8: bool | None = None) -> DraftHead:
    """The :class:`DraftHead` of ``target`` for a drafter in ``dtype`` (``int8``: see
    :attr:`~modeling_weaver.options.StepOptions.int8_head`; None: on CUDA). A copy of the weight (another dtype, or int8) is cached with the weight: made again after in-place updates of it,
    dropped with it."""
    head = target.get_output_embeddings()
    weight, bias = head.weight, head.bias
    int8 = StepOptions(int8_head=int8).int8_head_on(weight.device)
    if not int8 and weight.dtype == dtype:  # the weight itself: nothing to cache
        return DraftHead(weight, bias, dtype)
    key = (id(weight), dtype, int8)
    cached = _DRAFT_HEADS.get(key)
    if cached is None or cached[0] != weight._version or cached[1].weight is not weight:
        if cached is None:
            weakref.finalize(weight, _DRAFT_HEADS.pop, key, None)  # the copy goes with the weight
        with torch.no_grad():
            _DRAFT_HEADS[key] = cached = (weight._version, DraftHead(weight, bias, dtype, int8))
    return cached[1]


class DFlashStaticCache:
    """Context K/V of a DFlash drafter in fixed ``[1, kv_heads, rows, head_dim]`` buffers; row = position.

    ``update`` (called by each attention layer) writes the call's K/V at ``slots`` and returns the whole buffers;
    ``query_key_positions`` tells the layers where queries and keys sit (sliding / causal layer masks); ``attend``
    runs a layer's attention with :func:`weaver_kernels.tree_attention`, whose cost follows the rows in use, not the
    whole buffer as masked SDPA's does (5 layers × ≈ 50 µs over a 2048-row bucket at Qwen3.6-27B shape).
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
    """:class:`~modeling_weaver.generate.DFlashRunner` at fixed shapes (CUDA graph on CUDA); same ``draft`` contract.

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
        self.head = draft_head(target, self.dtype, options.int8_head_on(self.device))
        size = self.block_size
        self.rows = max_length + 2 * size  # pads sit after the block
        self.cache = DFlashStaticCache(drafter, self.rows, 2 * size, self.device, self.dtype)
        self.context = torch.zeros(size, drafter.fc.in_features, device=self.device, dtype=self.dtype)
        self.count = torch.zeros((), dtype=torch.long, device=self.device)  # real context rows
        self.n = self.cache.length  # position of the block's first token (the cache's attention reads it)
        # the additive mask is only for layers the cache's kernel does not take (or drafter code, e.g. an older
        # remote-code copy, that never hands the cache its attention)
        self.mask_needed = not all(getattr(layer.self_attn, "cache_attends", False)
                                   and self.cache.kernel_attends(layer.self_attn) for layer in drafter.layers)
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
                              past_key_values=self.cache, attention_mask=visible)[0, 1:]
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
                         past_key_values=self.cache, attention_mask=visible)
        finally:
            self.cache.slots, self.cache.length = graph_slots, graph_length

    def run(self, fn, key="draft"):
        """``fn()`` — replayed from a CUDA graph captured on first use (one per ``key``) when capturing."""
        if not self.capture:
            return fn()
        if key not in self._graphs:
            self._graphs[key] = capture_graph(fn)
        graph, out = self._graphs[key]
        graph.replay()
        return out

    def node_table(self, weaver) -> torch.Tensor:
        """``weaver.node_input_table`` of this target's embedding, made once per Weaver (its proposers share it)."""
        key = ("node_table", id(weaver))
        if key not in self._steps:  # (the Weaver kept with it: its id stays its own)
            self._steps[key] = (weaver, weaver.node_input_table(self.embed_tokens.weight))
        return self._steps[key][1]

    def proposer(self, mode: str, budget: int, weaver=None, shape_logits=None, compile: bool = False,
                 policy: TreePolicy = DEFAULT_POLICY) -> StaticProposer:
        """The :class:`StaticProposer` of this drafter for ``mode``, ``budget`` and ``policy`` (kept: its graph
        reads its buffers); ``compile``: its tree build ``torch.compile``d."""
        key = StaticProposer.key_of(mode, budget, weaver, shape_logits, compile, policy)
        if key not in self._steps:
            self._steps[key] = StaticProposer(self, mode, budget, weaver, shape_logits, compile, policy)
        return self._steps[key]

    def fused_step(self, proposer: StaticProposer, target: StaticTarget, acceptance=None) -> FusedGreedyStep:
        """The :class:`FusedGreedyStep` of ``proposer`` and ``target`` (kept: its graph reads their buffers).

        ``acceptance``: an object with a device ``tensors(tokens, parents, logits, ancestor_mask, logq)`` method
        returning ``(path, length, bonus)`` instead of greedy acceptance."""
        # steps built on a target step since replaced (its weights moved) would keep it alive, and its id reusable
        live = list(_STATIC_TARGETS.get(target.adapter.model, {}).values())
        for k in [k for k, v in self._steps.items()
                  if isinstance(v, FusedGreedyStep) and not any(v.target is t for t in live)]:
            del self._steps[k]
        key = ("fused", id(proposer), id(target), id(acceptance))
        if key not in self._steps:
            self._steps[key] = FusedGreedyStep(proposer, target, acceptance)
        step = self._steps[key]
        step.ready = False  # until a new generation arms it from its prefill
        return step

    @torch.no_grad()
    def draft(self, bonus: int, context: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`DFlashRunner.draft`: block ``[bonus, MASK…]`` at ``n..``, new ``context`` of ``n-C..n-1``."""
        self.load(bonus, context, n)
        return self.run(self._forward)


class StaticProposer:
    """Draft and tree build of one mode and budget at fixed shapes: one CUDA graph per step on CUDA.

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
                             self.last_hidden, self.draft.embed_tokens, self.draft.lm_head.weight, self.node_table,
                             self.policy)
        return hidden, logits, drafts

    @torch.no_grad()
    def propose(self, bonus: int, context: torch.Tensor, n: int, last_hidden: torch.Tensor):
        self.draft.load(bonus, context, n)
        self.last_hidden.copy_(last_hidden)
        hidden, logits, drafts = self.draft.run(self._forward, key=self.key)
        return hidden, logits, with_root(self.draft.bonus, drafts)  # (the root already on the device: no copy)


def adapter_state(adapter: TargetAdapter) -> list[torch.Tensor]:
    """The committed state a step of ``adapter`` advances in place (scratch K/V rows aside): restored around a
    captured step's warm-up."""
    tensors = [adapter.length_t]
    for cache in adapter.layer_caches:
        tensors += [cache.state, cache.window] if hasattr(cache, "state") else []
    return tensors


class PipelinedSteps:
    """Steps whose inputs the previous step left on the device, one CUDA graph each, launched one ahead of the host.

    A subclass gives ``_step()`` (returns a small ``[summary_size]`` long tensor: what the host reads), ``_state()``
    (what a step advances in place) and ``_parse(list)`` (the host side of a summary). :meth:`run` yields the parsed
    summaries; while the host reads step k, step k+1 already runs.
    """

    def __init__(self, device: torch.device, summary_size: int, capture: bool):
        self.capture = capture
        self._graph: tuple | None = None
        # Two host slots for summaries, one being read, one being filled, each with the event that says it is full
        # (a slot is launched again only after it was read).
        cuda = device.type == "cuda"
        self._host = [torch.zeros(summary_size, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self._events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._slot = 0

    def _launch(self) -> tuple[torch.Tensor, object]:
        """Start one step; returns ``(host slot, event)``: the slot holds its summary once the event has completed
        (no event: it holds it already)."""
        if not self.capture:
            return self._step(), None
        if self._graph is None:  # a warm-up step advances the state: restored
            self._graph = capture_graph(self._step, warmup=1, restore=self._state())
        self._graph[0].replay()
        host, event = self._host[self._slot], self._events[self._slot]
        self._slot = 1 - self._slot
        host.copy_(self._graph[1], non_blocking=True)  # ordered before the next replay overwrites the summary
        if event is not None:
            event.record()
        return host, event

    def _read(self, launched):
        host, event = launched
        if event is not None:
            event.synchronize()
        return self._parse(host.tolist())

    @torch.no_grad()
    def run(self, ahead=lambda: True):
        """Steps for as long as the caller iterates, yielding each one's parsed summary.

        Captured steps are pipelined: the next step is launched before this one's summary is read (its inputs are on
        the device already), so the GPU does not wait for the host between steps. ``ahead()`` may veto that (no room
        for one more step in the caches, or this step surely ends the generation); a step launched ahead and never
        read is only wasted work: the caches are reset before the next generation.
        """
        in_flight: list = []
        try:
            while True:
                if not in_flight:
                    in_flight.append(self._launch())
                if self.capture and ahead():
                    in_flight.append(self._launch())
                yield self._read(in_flight.pop(0))
        finally:
            for _, event in in_flight:  # an unread step still writes the caches: let it finish
                if event is not None:
                    event.synchronize()


class FusedGreedyStep(PipelinedSteps):
    """One whole greedy step — draft + tree, verify, accept, commit — at fixed shapes: one CUDA graph on CUDA.

    The step reads its inputs (the accepted path's target features, its length, the committed length, the bonus
    token, the last hidden state) from device buffers that the previous step wrote, so nothing returns to the host
    inside it and :meth:`run` yields ``(accepted tokens, root first; new bonus token)`` per step, pipelined.
    :meth:`arm` seeds the buffers from the prefill.
    """

    def __init__(self, proposer: StaticProposer, target: StaticTarget, acceptance=None):
        super().__init__(target.device, target.num_nodes + 2, proposer.draft.capture)
        self.proposer, self.target, self.acceptance = proposer, target, acceptance
        self.ready = False

    def arm(self, bonus: int, context: torch.Tensor, last_hidden: torch.Tensor) -> None:
        """Seed the buffers from the prefill: ``context`` the prompt's target features, ``last_hidden`` the target's
        final hidden state at its last position, ``bonus`` the first new token (the first step is a fused one too)."""
        self.proposer.draft.load(bonus, context, self.target.length)
        self.proposer.last_hidden.copy_(last_hidden)
        self.ready = True

    def _step(self) -> torch.Tensor:
        draft, adapter, size = self.proposer.draft, self.target.adapter, self.target.num_nodes
        # a chain has min(budget, depth) drafts: padded to the step's size
        tokens, parents, logq = rooted(draft.bonus, self.proposer._forward()[2], size)
        mask = ancestor_mask_of(parents)
        out = adapter.tree_step(tokens, parents, adapter.max_length, mask)
        if self.acceptance is None:
            path, length, bonus = accept_greedy_tensors(tokens, parents, out.logits, mask)
        else:  # e.g. the benchmark's replayed acceptance
            path, length, bonus = self.acceptance.tensors(tokens, parents, out.logits, mask, logq)
        adapter.commit_step(path)
        rows = min(size, draft.block_size)  # a path never exceeds the block
        draft.context[:rows].copy_(out.features[path[:rows].clamp(min=0)].to(draft.dtype))
        draft.count.copy_(length)
        draft.n.copy_(adapter.length_t)
        draft.bonus.copy_(bonus.view(1))
        self.proposer.last_hidden.copy_(out.hidden[path.gather(0, (length - 1).view(1))][0])
        return torch.cat([tokens[path], length.view(1), bonus.view(1)])

    def _state(self) -> list[torch.Tensor]:
        draft = self.proposer.draft
        tensors = [draft.context, draft.count, draft.n, draft.bonus, self.proposer.last_hidden]
        tensors += list(getattr(self.acceptance, "state", lambda: [])())  # e.g. a replayed trace's step counter
        return adapter_state(self.target.adapter) + tensors

    def _parse(self, summary: list[int]) -> tuple[list[int], int]:
        *accepted, n, bonus = summary
        self.target.adapter.length += n
        return accepted[:n], bonus


class FusedARStep(PipelinedSteps):
    """Our greedy AR step at fixed shapes — verify the last token, commit it, argmax — one CUDA graph on CUDA; the
    next step's input is this step's output, on the device. :meth:`run` yields one token per step, pipelined."""

    def __init__(self, target: StaticTarget):
        if target.num_nodes != 1:
            raise ValueError(f"an AR step verifies one node, not {target.num_nodes}")
        super().__init__(target.device, 1, target.capture)
        self.target = target

    def seed(self, token: int) -> None:
        """The token the first step verifies (the prefill's argmax)."""
        self.target.tokens.fill_(int(token))

    def _step(self) -> torch.Tensor:
        adapter, token = self.target.adapter, self.target.tokens
        out = adapter.token_step(token, adapter.max_length)  # verify + commit of the one-node tree, in one pass
        token.copy_(out.logits[0].argmax().view(1))
        return token

    def _state(self) -> list[torch.Tensor]:
        return adapter_state(self.target.adapter) + [self.target.tokens]

    def _parse(self, summary: list[int]) -> int:
        self.target.adapter.length += 1
        return summary[0]


_STATIC_TARGETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _kept(steps: dict, key, weights, build):
    """``steps[key]``, made by ``build()`` if missing; when the tensors ``weights()`` names changed since it was made,
    every step in ``steps`` is dropped first: they all read the old tensors (and keep them alive)."""
    if key in steps and steps[key].weights != weights():
        steps.clear()
    if key not in steps:
        step = build()
        step.weights = weights()  # (after building: a target's adapter may have moved weights into merged tensors)
        steps[key] = step
    return steps[key]


def cache_bucket(max_length: int) -> int:
    """Capacity of the static caches for ``max_length``: the next power of two, at least 256 (prompts of any length
    up to it share one set of graphs and compiled steps)."""
    return max(256, 1 << (max_length - 1).bit_length())


def capture_flags(target_step: str, device) -> dict:
    """``static_target`` options of a loop ``target_step``: ``"static"`` (fixed shapes, eager), ``"graph"`` (CUDA
    graphs on CUDA), ``"compiled"`` (``torch.compile``d tree pass, in CUDA graphs on CUDA)."""
    cuda = torch.device(device).type == "cuda"
    return {"capture": target_step in ("graph", "compiled") and cuda, "compile": target_step == "compiled"}


def static_target(model, max_length: int, num_nodes: int, feature_layer_ids=(), capture: bool | None = None,
                  compile: bool = False, max_tree_depth: int | None = None,
                  options: StepOptions = StepOptions()) -> StaticTarget:
    """The :class:`StaticTarget` of ``model`` for this capacity bucket, tree size and ``options``, reset for a new
    generation. ``max_tree_depth``, ``options``: as :class:`~modeling_weaver.target.TargetAdapter`'s.

    Capacity is ``max_length`` rounded up to a power of two (at least 256), so prompts of any length up to it share
    one set of graphs (and, with ``compile``, one compiled tree pass). The buffers live as long as the model
    (:func:`release_static_targets` frees them).
    """
    capacity = cache_bucket(max_length)
    steps = _STATIC_TARGETS.setdefault(model, {})
    key = (capacity, num_nodes, tuple(feature_layer_ids), capture, compile, max_tree_depth, options)

    def build() -> StaticTarget:
        adapter = TargetAdapter(model, capacity, feature_layer_ids, max_tree_depth, options)
        if compile:
            adapter.compile_tree_step()
        return StaticTarget(adapter, num_nodes, capture=capture)

    step = _kept(steps, key, lambda: weights_key(model), build)
    step.adapter.reset()
    return step


def static_draft(drafter, target, max_length: int, capture: bool | None = None,
                 options: StepOptions = StepOptions()) -> StaticDraft:
    """The :class:`StaticDraft` of ``drafter`` for this capacity bucket and ``options`` (as :func:`static_target`),
    kept on it."""
    capacity = cache_bucket(max_length)
    steps = _STATIC_TARGETS.setdefault(drafter, {})
    key = ("draft", capacity, id(target), capture, options)
    # what its graphs read: the drafter, the target's embedding and lm_head (the fused steps built on it go with it)
    def weights() -> tuple:
        return weights_key(drafter, target.get_input_embeddings(), target.get_output_embeddings())

    return _kept(steps, key, weights, lambda: StaticDraft(drafter, target, capacity, capture=capture, options=options))


def release_static_targets(model) -> None:
    """Drop the cached steps (caches and CUDA graphs) of ``model`` (a target or a drafter)."""
    _STATIC_TARGETS.pop(model, None)


__all__ = ["DFlashStaticCache", "DraftHead", "FusedARStep", "FusedGreedyStep", "PipelinedSteps", "StaticDraft",
           "StaticProposer", "StaticTarget", "adapter_state", "capture_graph", "draft_head", "release_static_targets",
           "capture_flags", "static_draft", "static_target"]

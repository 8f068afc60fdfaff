"""The verifier seam (docs/DESIGN.md §1, §5): ``prefill`` (commit the prompt), ``verify`` (one target pass over a
tree, nothing committed), ``commit`` (the accepted path), with ``length``, ``max_length``, ``device`` and
``max_tree_nodes``.

Two implementations: eager, :class:`~modeling_weaver.target.TargetAdapter` itself (each tree at its own size), and
:class:`StaticTarget`, the same adapter through fixed-shape steps: every verify pads the tree to ``num_nodes`` and
attends over the whole cache (``bound = max_length``), every commit takes the accepted path right-padded with -1 to
``num_nodes``. Inputs go through static buffers, and the committed length is read from the adapter's device tensor,
so nothing in either step depends on the prompt or the position: on CUDA each step is one CUDA graph, captured once
and replayed for any prompt length up to ``max_length``. Elsewhere (or with ``capture=False``) the same static-buffer
code runs eagerly — what the CPU tests exercise. One :class:`StaticTarget` per tree size (the commit graph reads the
outputs of its own verify graph); prefill stays eager (chunked, once per prompt). :class:`BucketedTarget` holds
several sizes over one adapter, for trees whose size changes from step to step (``tree_budget="auto"``).
"""

from __future__ import annotations

import torch

from ..target import TargetAdapter, TreeOutput
from ..tree import Tree, ancestor_mask_of
from . import graphs
from .fused import FusedARStep


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
        verify_graph, out = graphs.capture_graph(self._verify)
        commit_graph, _ = graphs.capture_graph(self._commit, pool=verify_graph.pool())
        self._graphs = (verify_graph, out, commit_graph)
        self.captures += 1


class BucketedTarget:
    """One :class:`TargetAdapter` behind fixed-shape steps of several tree sizes (``tree_budget="auto"`` with
    fixed-shape steps): each verify runs the smallest step that holds the tree, and the commit after it runs through
    the same step (its graph reads that verify's outputs). Steps are made, and on CUDA captured, on first use; all of
    them write the one adapter's caches. Same interface as :class:`StaticTarget` for the loop.

    Args:
        adapter: the target adapter.
        sizes: the node counts of the steps (draft nodes + the root).
        capture: capture CUDA graphs (default: when the adapter is on CUDA).
    """

    def __init__(self, adapter: TargetAdapter, sizes, capture: bool | None = None):
        self.sizes = tuple(sorted(set(sizes)))
        if not self.sizes or self.sizes[0] < 1:
            raise ValueError(f"bucket sizes count nodes (>= 1, the root included), got {sizes!r}")
        if adapter.max_tree_nodes is not None and self.sizes[-1] > adapter.max_tree_nodes:
            raise ValueError(f"{self.sizes[-1]} nodes exceed the {adapter.max_tree_nodes} the GDN tree kernel verifies")
        self.adapter, self.capture = adapter, capture
        self.steps: dict[int, StaticTarget] = {}
        self._verified: StaticTarget | None = None

    length = property(lambda self: self.adapter.length)
    max_length = property(lambda self: self.adapter.max_length)
    device = property(lambda self: self.adapter.device)
    max_tree_nodes = property(lambda self: self.adapter.max_tree_nodes)
    captures = property(lambda self: sum(step.captures for step in self.steps.values()))

    def step(self, nodes: int) -> StaticTarget:
        """The step of the smallest size that holds ``nodes`` nodes (made on first use)."""
        size = next((s for s in self.sizes if s >= nodes), None)
        if size is None:
            raise ValueError(f"a tree of {nodes} nodes does not fit the largest step ({self.sizes[-1]} nodes)")
        if size not in self.steps:
            self.steps[size] = StaticTarget(self.adapter, size, capture=self.capture)
        return self.steps[size]

    def prefill(self, input_ids: torch.Tensor, chunk_size: int = 128) -> TreeOutput:
        return self.adapter.prefill(input_ids, chunk_size)

    def verify(self, tree: Tree) -> TreeOutput:
        self._verified = self.step(len(tree))
        return self._verified.verify(tree)

    def commit(self, path) -> None:
        if self._verified is None:
            raise RuntimeError("commit() must follow verify()")
        step, self._verified = self._verified, None
        step.commit(path)

"""``tree_budget="auto"`` in whole greedy steps on the device (docs/DESIGN.md §12).

A drafting step is two captured steps and one host read: the first drafts and builds the tree at the largest size and
chooses its size on the device (:func:`~.budget.choose_on_device`); the host reads that choice (three integers) and
replays the chosen bucket's step, which cuts the tree to its best-first prefix, verifies, accepts, commits and updates
the acceptance calibration (:func:`~.budget.calibrate`), all on the device (:func:`~.fused.verify_and_commit`). While
the host reads a step's tokens, the next step's draft already runs. After the policy chose AR, the next steps verify
the last token alone in the smallest bucket without drafting, and the drafter reads their rows when it drafts again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..target import compile_static
from ..tree import ancestor_mask_of, rooted
from . import graphs
from .budget import AutoBudget, calibrate, choose_on_device, depth_factors
from .drafting import untimed
from .fused import adapter_state, verify_and_commit
from .step_cache import whole_steps

if TYPE_CHECKING:
    from ..accept import DeviceAcceptance
    from .drafting import StaticProposer
    from .verify import BucketedTarget


class FusedAutoSteps:
    """Greedy steps of adaptive size at fixed shapes: :meth:`arm`, then :meth:`run` yields ``(accepted tokens, root
    first; bonus; tree size)`` per step, as :class:`~.loop.SplitSteps` does.

    Kept with the proposer's drafter across generations (:func:`auto_steps`: its graphs read the buffers here);
    :meth:`start` hands it each generation's :class:`~.budget.AutoBudget`.

    Args:
        proposer: the fixed-shape proposer at the largest candidate size; target: the buckets of every size.
        sizes: the candidate draft counts; decay: :attr:`~modeling_weaver.options.BudgetPolicy.decay`.
        acceptance: a :class:`~modeling_weaver.accept.DeviceAcceptance` instead of greedy acceptance.
        compile: ``torch.compile`` the choice, the cut and the calibration update (None: when the steps are captured
            on CUDA, where their ~150 small ops would each be a kernel of a few µs in every step's graphs).
    """

    def __init__(self, proposer: StaticProposer, target: BucketedTarget, sizes: tuple[int, ...], decay: float,
                 acceptance: DeviceAcceptance | None = None, compile: bool | None = None):
        if proposer.budget != max(sizes):
            raise ValueError(f"the proposer builds {proposer.budget} drafts, the largest size is {max(sizes)}")
        device = target.device
        self.proposer, self.target, self.sizes_list, self.decay = proposer, target, sizes, decay
        self.acceptance, self.timed, self.sizer = acceptance, untimed, None
        self.capture = proposer.draft.capture
        if compile is None:
            compile = self.capture and torch.device(target.device).type == "cuda"
        self._decide, self._cut, self._calibrate = ((compile_static(decide), compile_static(prefix_cut),
                                                     compile_static(calibrate)) if compile
                                                    else (decide, prefix_cut, calibrate))
        self.sizes = torch.tensor(sizes, device=device)
        self.num_nodes = max(sizes) + 1
        depths = proposer.block_size  # (a draft's depth is below the block size)
        # the generation's costs and calibration, in buffers the graphs read (:meth:`start` fills them)
        self.verify_ms = torch.zeros(self.num_nodes, dtype=torch.float64, device=device)
        self.propose_ms = torch.zeros((), dtype=torch.float64, device=device)
        self.observed, self.predicted, self.prior = torch.zeros(3, depths, dtype=torch.float64, device=device)
        # the drafted tree and its choice, for the chosen bucket's step
        self.tokens = torch.zeros(self.num_nodes, dtype=torch.long, device=device)
        self.parents = torch.full((self.num_nodes,), -1, dtype=torch.long, device=device)
        self.logq = torch.zeros(self.num_nodes, dtype=torch.float32, device=device)
        self.rank = torch.zeros(self.num_nodes, dtype=torch.long, device=device)
        self.mask = torch.zeros(self.num_nodes, self.num_nodes, dtype=torch.bool, device=device)
        self.sums = torch.zeros(depths, dtype=torch.float64, device=device)
        self.choice = torch.zeros(3, dtype=torch.long, device=device)
        self._graphs: dict = {}
        self.pending: list[torch.Tensor] | None = None  # context rows since the last draft (AR steps), else None
        self.bonus = self.accepted = 0

    def start(self, sizer: AutoBudget, timed=untimed) -> FusedAutoSteps:
        """This generation's policy: its costs and calibration go to the device buffers, where the steps update the
        calibration (they replace the sizer's host floats, so its report reads them)."""
        if tuple(sizer.sizes) != self.sizes_list or sizer.policy.decay != self.decay:
            raise ValueError("the fused auto steps were made for other sizes or another decay")
        self.verify_ms.copy_(torch.tensor([sizer.costs.verify(k) for k in range(self.num_nodes)]))
        self.propose_ms.fill_(sizer.costs.propose_ms)
        for name in ("observed", "predicted", "prior"):
            getattr(self, name).copy_(torch.as_tensor(getattr(sizer, name), dtype=torch.float64))
            setattr(sizer, name, getattr(self, name))
        self.sizer, self.timed = sizer, timed
        return self

    def arm(self, bonus: int, context: torch.Tensor, last_hidden: torch.Tensor) -> None:
        """Seed the drafter's buffers from the prefill (as :meth:`~.fused.FusedGreedyStep.arm`)."""
        self.proposer.draft.load(bonus, context, self.target.length)
        self.proposer.last_hidden.copy_(last_hidden)
        self.pending, self.bonus = None, bonus

    def _choose(self) -> torch.Tensor:
        tokens, parents, logq = rooted(self.proposer.draft.bonus, self.proposer._forward()[2], self.num_nodes)
        choice, rank, sums, mask = self._decide(parents, logq, self.observed, self.predicted, self.prior, self.sizes,
                                                self.verify_ms, self.propose_ms)
        for buffer, value in ((self.tokens, tokens), (self.parents, parents), (self.logq, logq), (self.rank, rank),
                              (self.sums, sums), (self.choice, choice), (self.mask, mask)):
            buffer.copy_(value)
        return self.choice

    def _verify(self, nodes: int) -> torch.Tensor:
        tokens, parents, logq, mask = self._cut(self.rank < self.choice[2], self.tokens, self.parents, self.logq,
                                                self.mask, nodes)
        tokens = torch.cat([self.proposer.draft.bonus, tokens[1:]])  # (an AR step's root: no choice has seen it)
        summary, length = verify_and_commit(self.proposer, self.target.adapter, self.acceptance, tokens, parents,
                                            logq, mask)
        self._calibrate(self.observed, self.predicted, self.prior, self.sums, length, self.decay)
        return summary

    def _state(self) -> list[torch.Tensor]:
        """What a bucket's step advances in place (restored around its capture's warm-up)."""
        draft = self.proposer.draft
        tensors = [draft.context, draft.count, draft.n, draft.bonus, self.proposer.last_hidden, self.observed,
                   self.predicted, self.prior]
        return adapter_state(self.target.adapter) + tensors + (self.acceptance.state() if self.acceptance else [])

    def _launch(self, key, fn, state=list):
        """Run ``fn`` (replayed from a CUDA graph captured on first use per ``key`` when capturing; ``state()``: what
        it advances in place, restored around the capture's warm-up); returns what :func:`~.graphs.read` reads."""
        if not self.capture:
            return fn()
        if key not in self._graphs:
            graph, out = graphs.capture_graph(fn, warmup=1, restore=state())
            self._graphs[key] = (graph, out, graphs.HostSlot(self.target.device, out.shape[0]))
        graph, out, slot = self._graphs[key]
        graph.replay()
        return slot.fill(out)

    def _launch_choice(self):
        return self._launch("choose", self._choose)

    def _launch_bucket(self, index: int):
        nodes = self.sizes_list[index] + 1
        return self._launch(index, lambda: self._verify(nodes), self._state)

    @torch.no_grad()
    def run(self, ahead=lambda: True):
        sizer, adapter, draft = self.sizer, self.target.adapter, self.proposer.draft
        chosen = None  # a choice launched ahead
        try:
            while True:
                with self.timed("step"):
                    if sizer.drafts():
                        if self.pending is not None:  # the AR steps' rows go to the drafter with the new block
                            draft.load(self.bonus, torch.cat(self.pending), adapter.length)
                            self.pending = None
                        bucket, ar, drafts = graphs.read(chosen or self._launch_choice())
                        chosen = None
                        sizer.steady(bool(ar), drafts == 0)
                        launched = self._launch_bucket(bucket)
                        if self.capture and not sizer.skip and ahead():
                            chosen = self._launch_choice()
                    else:  # an AR step: the root alone in the smallest bucket, nothing learned
                        if self.pending is None:
                            self.pending = [draft.context[:self.accepted].clone()]
                            self.choice.zero_()
                            self.sums.zero_()
                        launched, drafts = self._launch_bucket(0), 0
                    *tokens, length, self.bonus = graphs.read(launched)
                    adapter.length += length
                    self.accepted = length
                    if self.pending is not None:
                        self.pending.append(draft.context[:1].clone())
                yield tokens[:length], self.bonus, drafts + 1
        finally:
            if chosen is not None:  # an unread draft still writes the drafter's cache: let it finish
                graphs.read(chosen)


def decide(parents: torch.Tensor, logq: torch.Tensor, observed: torch.Tensor, predicted: torch.Tensor,
           prior: torch.Tensor, sizes: torch.Tensor, verify_ms: torch.Tensor, propose_ms: torch.Tensor):
    """A drafted tree's choice from the calibration's sums (:func:`~.budget.choose_on_device`), and its ancestor
    mask: ``choice, rank, sums, mask``."""
    mask = ancestor_mask_of(parents)
    factors = depth_factors(observed, predicted, prior)
    return *choose_on_device(parents, logq, factors, sizes, verify_ms, propose_ms, mask), mask


def prefix_cut(keep: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, logq: torch.Tensor,
               mask: torch.Tensor, nodes: int):
    """``tokens, parents, logq, mask`` of the subtree ``keep`` (closed under ancestors, the root kept, at most
    ``nodes`` nodes) in the tree's order, padded with padding roots (token 0, parent -1, ``logq`` -inf) to ``nodes``;
    its ancestor mask taken from the whole tree's ``mask`` (a few gathers instead of pointer doubling again)."""
    picked = torch.sort((~keep).int(), stable=True).indices[:nodes]
    kept, above = keep[picked], parents[picked]
    number = keep.long().cumsum(0) - 1
    cut_parents = torch.where(kept & (above >= 0), number[above.clamp(min=0)], -1)
    self_only = torch.eye(nodes, dtype=torch.bool, device=mask.device)
    cut_mask = torch.where(kept[:, None], mask[picked][:, picked], self_only)  # a kept node's ancestors are kept
    return (torch.where(kept, tokens[picked], 0), cut_parents, torch.where(kept, logq[picked], float("-inf")),
            cut_mask)


def auto_steps(proposer: StaticProposer, target: BucketedTarget, sizes: tuple[int, ...], decay: float,
               acceptance: DeviceAcceptance | None = None) -> FusedAutoSteps:
    """The :class:`FusedAutoSteps` of ``proposer`` and ``target`` for these sizes and decay, kept with the proposer's
    drafter as :func:`~.step_cache.fused_step` keeps its steps (later generations replay the same graphs)."""
    key = ("auto", id(proposer), id(target), id(acceptance), tuple(sizes), decay)
    return whole_steps(proposer, target, key, lambda: FusedAutoSteps(proposer, target, sizes, decay, acceptance))

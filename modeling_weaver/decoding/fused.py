"""Whole steps on the device, pipelined one ahead of the host (docs/DESIGN.md §1): the fused greedy step (draft +
tree, verify, acceptance, commit) and our AR step (verify + commit of one token, argmax); :func:`verify_and_commit`,
the device half of a greedy step, is shared with the adaptive-size steps (:mod:`.adaptive`).

Each step reads its inputs from device buffers the previous step wrote and returns a small summary for the host, so
on CUDA it is one CUDA graph (:class:`~.graphs.PipelinedSteps`). The buffers they read belong to a
:class:`~.drafting.StaticProposer` and a :class:`~.verify.StaticTarget`; this module imports neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..accept import DeviceAcceptance, accept_greedy_tensors
from ..tree import ancestor_mask_of, rooted
from .graphs import PipelinedSteps

if TYPE_CHECKING:
    from ..target import TargetAdapter
    from .drafting import StaticProposer
    from .verify import StaticTarget


def adapter_state(adapter: TargetAdapter) -> list[torch.Tensor]:
    """The committed state a step of ``adapter`` advances in place (scratch K/V rows aside): restored around a
    captured step's warm-up."""
    tensors = [adapter.length_t]
    for cache in adapter.layer_caches:
        tensors += [cache.state, cache.window] if hasattr(cache, "state") else []
    return tensors


def verify_and_commit(proposer: StaticProposer, adapter: TargetAdapter, acceptance: DeviceAcceptance | None,
                      tokens: torch.Tensor, parents: torch.Tensor, logq: torch.Tensor,
                      mask: torch.Tensor | None = None):
    """The device half of a greedy step on a rooted tree: verify, accept (greedy, or ``acceptance``), commit, and
    leave the next draft's inputs in the proposer's buffers. Returns the summary ``[tokens of the path (padded),
    length, bonus]`` and the accepted length (0-d). ``mask``: the tree's ancestor mask, when the caller has it."""
    draft, size = proposer.draft, tokens.shape[0]
    mask = ancestor_mask_of(parents) if mask is None else mask
    out = adapter.tree_step(tokens, parents, adapter.max_length, mask)
    if acceptance is None:
        path, length, bonus = accept_greedy_tensors(tokens, parents, out.logits, mask)
    else:  # e.g. the benchmark's replayed acceptance
        path, length, bonus = acceptance.tensors(tokens, parents, out.logits, mask, logq)
    adapter.commit_step(path)
    rows = min(size, draft.block_size)  # a path never exceeds the block
    draft.context[:rows].copy_(out.features[path[:rows].clamp(min=0)].to(draft.dtype))
    draft.count.copy_(length)
    draft.n.copy_(adapter.length_t)
    draft.bonus.copy_(bonus.view(1))
    proposer.last_hidden.copy_(out.hidden[path.gather(0, (length - 1).view(1))][0])
    return torch.cat([tokens[path], length.view(1), bonus.view(1)]), length


class FusedGreedyStep(PipelinedSteps):
    """One whole greedy step — draft + tree, verify, accept, commit — at fixed shapes: one CUDA graph on CUDA.

    The step reads its inputs (the accepted path's target features, its length, the committed length, the bonus
    token, the last hidden state) from device buffers that the previous step wrote, so nothing returns to the host
    inside it and :meth:`run` yields ``(accepted tokens, root first; new bonus token)`` per step, pipelined.
    :meth:`arm` seeds the buffers from the prefill. ``acceptance``: a
    :class:`~modeling_weaver.accept.DeviceAcceptance` instead of greedy acceptance.
    """

    def __init__(self, proposer: StaticProposer, target: StaticTarget, acceptance: DeviceAcceptance | None = None):
        super().__init__(target.device, target.num_nodes + 2, proposer.draft.capture)
        self.proposer, self.target, self.acceptance = proposer, target, acceptance

    def arm(self, bonus: int, context: torch.Tensor, last_hidden: torch.Tensor) -> None:
        """Seed the buffers from the prefill: ``context`` the prompt's target features, ``last_hidden`` the target's
        final hidden state at its last position, ``bonus`` the first new token (the first step is a fused one too)."""
        self.proposer.draft.load(bonus, context, self.target.length)
        self.proposer.last_hidden.copy_(last_hidden)

    def _step(self) -> torch.Tensor:
        # a chain has min(budget, depth) drafts: padded to the step's size
        tokens, parents, logq = rooted(self.proposer.draft.bonus, self.proposer._forward()[2], self.target.num_nodes)
        return verify_and_commit(self.proposer, self.target.adapter, self.acceptance, tokens, parents, logq)[0]

    def _state(self) -> list[torch.Tensor]:
        draft = self.proposer.draft
        tensors = [draft.context, draft.count, draft.n, draft.bonus, self.proposer.last_hidden]
        tensors += self.acceptance.state() if self.acceptance is not None else []  # e.g. a trace's step counter
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

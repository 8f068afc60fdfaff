"""The speculative decoding loop, batch 1 (docs/DESIGN.md §1): prefill, then steps of propose → verify → accept →
commit until a stopping rule fires.

One step, top to bottom: :func:`_decode` (here) asks :func:`plan_steps` once, before the loop, for the verifier (eager
:class:`~modeling_weaver.target.TargetAdapter` or fixed-shape :class:`~.verify.StaticTarget`), the proposer (eager
:class:`~.drafting.EagerProposer` or fixed-shape :class:`~.drafting.StaticProposer`) and how steps run:
:class:`SplitSteps` (propose, verify, accept on the host, commit: :mod:`.drafting`, :mod:`..tree`, :mod:`..target`,
:mod:`..accept`) or, greedy with a fixed-shape proposer and no processors, :class:`FusedSteps` (the whole step on the
device, :mod:`.fused`; with ``tree_budget="auto"`` :class:`~.adaptive.FusedAutoSteps`, the size chosen there too).
The loop itself only emits what each step accepted.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from transformers.generation import LogitsProcessorList, StoppingCriteriaList

from ..accept import DeviceAcceptance, accept_greedy, accept_target_only, accept_traversal
from ..options import BudgetPolicy, StepOptions, TreePolicy
from ..target import TargetAdapter, capturable_experts
from ..tree import Tree, node_depths
from ..validation import row_wise
from .adaptive import FusedAutoSteps, auto_steps
from .budget import AutoBudget, auto_sizes, step_costs
from .drafting import DFlashRunner, EagerProposer, Proposer, RankZeroProposer, StaticProposer, untimed
from .fused import FusedGreedyStep
from .step_cache import capture_flags, fused_step, static_buckets, static_draft, static_target
from .verify import BucketedTarget, StaticTarget


@dataclass
class SpeculativeStats:
    """Per-generation statistics. ``accepted_lengths[s]`` counts the tokens committed at verify step s (bonus incl.);
    ``tree_sizes[s]`` the nodes it verified, root included (1: an AR step of ``tree_budget="auto"``)."""

    accepted_lengths: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    num_new_tokens: int = 0
    mode: str = ""  # the tree mode that ran ("weaver", "ddtree" or "chain")
    phase_ms: dict[str, float] = field(default_factory=dict)  # summed over steps, when timed (PhaseTimer)
    calibration: dict | None = None  # tree_budget="auto": the costs, candidate sizes and final depth factors used

    @property
    def size_histogram(self) -> dict[int, int]:
        """Steps per number of draft nodes verified (0: AR steps)."""
        counts: dict[int, int] = {}
        for size in self.tree_sizes:
            counts[size - 1] = counts.get(size - 1, 0) + 1
        return dict(sorted(counts.items()))

    @property
    def num_steps(self) -> int:
        return len(self.accepted_lengths)

    @property
    def mean_accepted_length(self) -> float:
        """MAL τ: tokens committed per verify step, bonus included."""
        return sum(self.accepted_lengths) / max(1, self.num_steps)


TARGET_STEPS = ("eager", "static", "graph", "compiled")


# Loop phases in report order; eager steps time draft, tree, verify, accept, commit; fixed-shape steps draft+tree
# instead of draft and tree; a fused greedy step is one "step" (so the phases of one step never overlap).
PHASES = ("draft", "tree", "draft+tree", "verify", "accept", "commit", "step")


class PhaseTimer:
    """Time spent in each phase of the loop (draft, tree — or draft+tree for a fixed-shape proposer —, verify,
    accept, commit), summed over steps.

    CUDA events on CUDA (no sync inside the loop; :meth:`totals_ms` synchronises once), wall time elsewhere.
    """

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.spans: dict[str, list] = defaultdict(list)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.spans[phase].append((start, end))
        else:
            start = time.perf_counter()
            yield
            self.spans[phase].append(1e3 * (time.perf_counter() - start))

    def totals_ms(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
            return {k: sum(s.elapsed_time(e) for s, e in v) for k, v in self.spans.items()}
        return {k: sum(v) for k, v in self.spans.items()}


class _Output:
    """Emitted tokens, stopping rules and the streamer, one token at a time.

    The ids live on the host, so stopping rules and the streamer read them without waiting for the device: a device
    tensor here would make each emitted token wait behind the step already queued ahead (a copy to, or a read from,
    the device is ordered after it). Stopping criteria therefore see CPU ``input_ids`` (transformers' own criteria
    move their tensors to ``input_ids.device``)."""

    def __init__(self, prompt: torch.Tensor, max_new_tokens: int, stopping_criteria: StoppingCriteriaList, streamer):
        self.device, self.prompt_len = prompt.device, prompt.shape[0]
        self._ids = torch.empty(1, self.prompt_len + max_new_tokens, dtype=prompt.dtype)
        self._ids[0, :self.prompt_len] = prompt.cpu()
        self.length = self.prompt_len
        self.stopping_criteria, self.streamer = stopping_criteria, streamer
        self.done = False

    @property
    def ids(self) -> torch.Tensor:
        """``[1, prompt + emitted]`` on the host."""
        return self._ids[:, :self.length]

    def emit(self, tokens: list[int]) -> int:
        """Append tokens until a stopping rule fires or ``max_new_tokens`` are out; returns how many were kept."""
        kept = 0
        for tok in tokens:
            if self.done:
                break
            self._ids[0, self.length] = tok
            self.length += 1
            kept += 1
            self.done = bool(self.stopping_criteria(self.ids, None).any()) or self.length == self._ids.shape[1]
        if kept and self.streamer is not None:
            self.streamer.put(self.ids[0, -kept:].clone())
        return kept


class Scores:
    """The processed scores of tree nodes (``processors`` then softmax when sampling), as sequential decoding would
    see them after the emitted ids of ``out``."""

    def __init__(self, processors: LogitsProcessorList, do_sample: bool, out: _Output):
        self.processors, self.do_sample, self.out = processors, do_sample, out
        self.by_length = any(not row_wise(proc) for proc in processors)

    def __call__(self, logits: torch.Tensor, parents: torch.Tensor | None = None) -> torch.Tensor:
        """Processed scores of every node (``parents``: the tree's; None: one row after the emitted ids)."""
        scores, processors, ids = logits.float(), self.processors, self.out.ids
        if processors and (not self.by_length or parents is None):  # the ids so far stand in for every row
            scores = processors(ids.to(logits.device).expand(logits.shape[0], -1), scores)
        elif processors:  # a node of depth d continues the emitted ids by d tokens: its processors see that length
            depths = node_depths(parents.to(logits.device))
            for d in sorted(set(depths.tolist())):
                rows = (depths == d).nonzero()[:, 0]
                longer = torch.cat([ids, ids.new_zeros(1, d)], 1).to(logits.device)  # (length-only readers)
                scores[rows] = processors(longer.expand(rows.shape[0], -1), scores[rows])
        return scores.softmax(-1) if self.do_sample else scores

    def first_token(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        """The token after the prompt, from its last row's ``logits``."""
        scores = self(logits[None])
        if self.do_sample:
            return int(torch.multinomial(scores.cpu(), 1, generator=generator))
        return int(scores.argmax(-1))


class SplitSteps:
    """Steps as separate calls: the proposer's draft and tree, the verifier's pass, the acceptance rule on the host
    (on the processed scores), the verifier's commit. :meth:`run` yields ``(accepted tokens, root first; bonus; tree
    size)`` per step. With a ``sizer`` (:class:`~.budget.AutoBudget`, ``tree_budget="auto"``) it decides whether a
    step drafts and cuts each tree to the size it chooses."""

    def __init__(self, proposer: Proposer, verifier, accept, scores: Scores, timed, sizer: AutoBudget | None = None):
        self.proposer, self.verifier, self.accept, self.scores, self.timed = proposer, verifier, accept, scores, timed
        self.sizer = sizer

    def arm(self, bonus: int, context: torch.Tensor, last_hidden: torch.Tensor) -> None:
        """The first step's inputs: the first new token, the prompt's target features and last hidden state."""
        self.bonus, self.context, self.last_hidden = bonus, context, last_hidden

    def run(self, ahead=None):
        timed, verifier = self.timed, self.verifier
        sizer = self.sizer
        while True:
            drafts = sizer is None or sizer.drafts()
            if drafts:
                tree = self.proposer.propose(self.bonus, self.context, verifier.length, self.last_hidden, timed,
                                             budget=None if sizer is None else sizer.build).tree
                if sizer is not None:
                    with timed("tree"):
                        tree = sizer.choose(tree)
            else:  # an AR step: the root alone
                tree = Tree.from_lists([self.bonus], [-1], device=verifier.device)
            with timed("verify"):
                verified = verifier.verify(tree)
            with timed("accept"):
                accepted = self.accept(tree, self.scores(verified.logits, tree.parents))
            with timed("commit"):
                verifier.commit(accepted.path)
            if sizer is not None:
                sizer.observe(len(accepted.path))
            context = verified.features[accepted.path]
            # the drafter reads every committed position once: without a draft this step, the context grows
            self.context = context if drafts else torch.cat([self.context, context])
            self.last_hidden = verified.hidden[accepted.path[-1]]
            self.bonus = accepted.bonus
            yield tree.tokens[accepted.path].tolist(), accepted.bonus, len(tree)


class FusedSteps:
    """Whole greedy steps on the device (:class:`~.fused.FusedGreedyStep`, pipelined one ahead on CUDA), each timed
    as one phase ``step``. :meth:`run` yields as :meth:`SplitSteps.run` does."""

    def __init__(self, step: FusedGreedyStep, timed):
        self.step, self.timed = step, timed

    def arm(self, bonus: int, context: torch.Tensor, last_hidden: torch.Tensor) -> None:
        self.step.arm(bonus, context, last_hidden)  # (untimed: the prompt's drafter pass is no step's phase)

    def run(self, ahead):
        with contextlib.closing(self.step.run(ahead)) as steps:
            while True:
                with self.timed("step"):  # (pipelined: a span holds the GPU time of the step launched ahead in it)
                    tokens, bonus = next(steps)
                yield tokens, bonus, self.step.target.num_nodes


@dataclass
class Plan:
    """What one generation runs, chosen once before the loop: the verifier and the steps (proposer inside)."""

    verifier: TargetAdapter | StaticTarget | BucketedTarget
    steps: SplitSteps | FusedSteps | FusedAutoSteps  # each: arm(bonus, context, last_hidden), then run(ahead)
    sizer: AutoBudget | None = None  # tree_budget="auto"


def acceptance_rule(accept, do_sample: bool, verification: str, generator):
    """``accept(tree, scores) → Acceptance``: the one given, greedy, or a sampling rule (docs/DESIGN.md §6)."""
    if accept is not None:
        return accept
    if not do_sample:
        return accept_greedy
    rule = accept_traversal if verification == "traversal" else accept_target_only
    return lambda tree, scores: rule(tree, scores, generator)


def plan_steps(target, runner, *, mode: str, tree_budget: int, weaver, target_step: str, max_length: int, device,
               accept, scores: Scores, timed, generator, verification: str, tree_policy: TreePolicy,
               step_options: StepOptions, auto: BudgetPolicy | None = None, sizes: tuple[int, ...] = ()) -> Plan:
    """The factory: the verifier of ``target_step``, the proposer for ``runner`` (a :class:`~.drafting.Proposer` as
    it is; a :class:`~.drafting.DFlashRunner` at fixed shapes when the target's steps are; any other drafting runner
    eager), and fused steps when greedy decoding needs nothing from the host (no processors, device acceptance).
    With ``auto`` (``tree_budget="auto"``), ``tree_budget`` is the largest of ``sizes`` and each step's size is
    chosen among them (:class:`~.budget.AutoBudget`); fixed-shape steps then verify in a step of each size
    (:class:`~.verify.BucketedTarget`), greedy ones as whole steps that choose on the device
    (:class:`~.adaptive.FusedAutoSteps`)."""
    depth = runner.block_size - 1  # every tree drafts within one block: the bound picks the GDN verify kernel
    costs = None
    if auto is not None:  # (first: a fixed-shape calibration runs the generation's own steps, which are reset below)
        costs = step_costs(target, runner, weaver, mode, sizes, tree_policy, step_options, auto, target_step)
    if target_step != "eager" and len({p.device for p in target.parameters()}) > 1:
        raise ValueError(f'target_step="{target_step}" needs a target on one device; this one is split over '
                         f'{sorted(str(d) for d in {p.device for p in target.parameters()})} (device_map): use '
                         f'target_step="eager", which runs each layer where it lives (CUDA graphs capture one device)')
    if target_step == "eager":
        verifier = TargetAdapter(target, max_length=max_length, feature_layer_ids=runner.feature_layer_ids,
                                 max_tree_depth=depth, options=step_options)
    else:  # kept per target and drafter: later generations replay the same graphs
        flags = capture_flags(target_step, device)
        if auto is not None:
            verifier = static_buckets(target, max_length, [s + 1 for s in sizes], runner.feature_layer_ids, **flags,
                                      max_tree_depth=depth, options=step_options)
        else:
            verifier = static_target(target, max_length, tree_budget + 1, runner.feature_layer_ids, **flags,
                                     max_tree_depth=depth, options=step_options)
    if verifier.max_tree_nodes is not None and tree_budget + 1 > verifier.max_tree_nodes:
        raise ValueError(f"tree_budget {tree_budget} is too large for this hybrid target on {verifier.device}: the "
                         f"GDN tree kernel verifies at most {verifier.max_tree_nodes} nodes (budget + root)")
    rank0 = step_options.tp_drafter == "rank0" and torch.distributed.is_available() and (
        torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1)
    if rank0 and target_step != "eager":
        raise ValueError('StepOptions.tp_drafter="rank0" drafts with eager steps: pass target_step="eager"')
    if rank0 and isinstance(runner, DFlashRunner):  # rank 0 drafts alone: its head and embedding must be local
        runner = DFlashRunner(runner.drafter, target, step_options, local=True)
    if isinstance(runner, Proposer):
        proposer = runner
    elif target_step != "eager" and isinstance(runner, DFlashRunner):  # draft + tree build as one fixed-shape step
        proposer = static_draft(runner.drafter, target, max_length, flags["capture"], options=step_options).proposer(
            mode, tree_budget, weaver if mode == "weaver" else None, compile=flags["compile"], policy=tree_policy)
    else:
        proposer = EagerProposer(runner, mode, tree_budget, weaver, target, tree_policy, local=rank0)
    if rank0:
        proposer = RankZeroProposer(proposer, verifier.device)
    sizer = None if auto is None else AutoBudget(auto, costs, auto.choices(sizes, target_step), depth,
                                                 auto.look_ahead_on(device) if proposer.resizable else 0)
    on_device = accept is None or isinstance(accept, DeviceAcceptance)
    if isinstance(proposer, StaticProposer) and not scores.do_sample and not scores.processors and on_device:
        if sizer is not None:  # (the size chosen on the device, each bucket's step whole)
            steps = auto_steps(proposer, verifier, sizer.sizes, auto.decay, accept).start(sizer, timed)
            return Plan(verifier, steps, sizer)
        return Plan(verifier, FusedSteps(fused_step(proposer, verifier, accept), timed))
    rule = acceptance_rule(accept, scores.do_sample, verification, generator)
    return Plan(verifier, SplitSteps(proposer, verifier, rule, scores, timed, sizer), sizer)


@torch.no_grad()
def _decode(target, prompt: torch.Tensor, *, runner, weaver, mode: str, tree_budget: int | str, max_new_tokens: int,
            processors: LogitsProcessorList, do_sample: bool, verification: str | None,
            stopping_criteria: StoppingCriteriaList, streamer, generator: torch.Generator | None,
            target_step: str = "eager", timer: PhaseTimer | None = None, accept=None,
            tree_policy: TreePolicy = TreePolicy(), step_options: StepOptions = StepOptions(),
            budget_policy: BudgetPolicy | None = None) -> tuple[torch.Tensor, SpeculativeStats]:
    """The loop. ``runner``: a drafting runner or a :class:`~.drafting.Proposer` (see :func:`plan_steps`); ``timer``
    times its phases into ``stats.phase_ms``; ``accept(tree, scores) → Acceptance`` replaces the acceptance rule (a
    :class:`~modeling_weaver.accept.DeviceAcceptance` also runs inside fused steps). ``tree_budget="auto"`` chooses
    each step's size as ``budget_policy`` (default :class:`~modeling_weaver.options.BudgetPolicy`) says."""
    if target_step not in TARGET_STEPS:
        raise ValueError(f"target_step must be one of {TARGET_STEPS}, got {target_step!r}")
    tree_budget, budget_policy, sizes = auto_sizes(tree_budget, budget_policy, target, prompt.device)
    stats, out = SpeculativeStats(mode=mode), _Output(prompt, max_new_tokens, stopping_criteria, streamer)
    scores = Scores(processors, do_sample, out)
    max_length = prompt.shape[0] + max_new_tokens + tree_budget + 2
    # (every capture of a generation happens inside: its verify, fused and bucketed steps, and the calibration's)
    with capturable_experts(target, prompt.device, target_step):
        plan = plan_steps(target, runner, mode=mode, tree_budget=tree_budget, weaver=weaver,
                          target_step=target_step, max_length=max_length, device=prompt.device, accept=accept,
                          scores=scores, timed=timer or untimed, generator=generator,
                          verification=verification or ("traversal" if mode == "weaver" else "target_only"),
                          tree_policy=tree_policy, step_options=step_options, auto=budget_policy, sizes=sizes)
        verifier = plan.verifier
        verified = verifier.prefill(prompt)
        bonus = scores.first_token(verified.logits[-1], generator)
        stats.num_new_tokens += out.emit([bonus])
        if not out.done:  # (arming may run the drafter over the prompt: not for an output that is complete already)
            plan.steps.arm(bonus, verified.features, verified.hidden[-1])
        # Launch a fused step ahead only if one more fits in the caches and the step in flight (≤ block new tokens)
        # cannot reach max_new_tokens: a step launched after the last one is a whole step of wasted GPU time.
        block = runner.block_size
        ahead = (lambda: verifier.length + block + tree_budget + 1 <= verifier.max_length
                 and stats.num_new_tokens + block < max_new_tokens)
        with contextlib.closing(plan.steps.run(ahead=ahead)) as steps:
            while not out.done:
                tokens, bonus, size = next(steps)
                stats.accepted_lengths.append(len(tokens))
                stats.tree_sizes.append(size)
                stats.num_new_tokens += out.emit(tokens[1:] + [bonus])
    if timer is not None:
        stats.phase_ms = timer.totals_ms()
    if plan.sizer is not None:
        stats.calibration = plan.sizer.report()
    if streamer is not None:
        streamer.end()
    return out.ids.to(out.device, copy=True), stats  # (a copy: not a view of the host buffer)

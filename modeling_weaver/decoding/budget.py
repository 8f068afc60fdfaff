"""``tree_budget="auto"``: each step verifies the tree size that maximises expected tokens per second
(docs/DESIGN.md §12).

- **Cost** (:class:`CostTable`, :func:`step_costs`): milliseconds of a step's verify + accept + commit against
  the number of draft nodes (0: a plain AR step), and of draft + tree build at the largest size. Measured once on
  dummy inputs with the generation's own target, drafter and tree mode, then cached as JSON under the cache folder,
  keyed by the device, the target (class, config, dtype, module types), the step kind and the drafting setup.
- **Value** (:func:`best_first`, :func:`expected_lengths`): the tree is built at the largest size (eager steps on
  a CPU: the size chosen last, now and then one draft past it, :attr:`AutoBudget.build`); its nodes in
  best-first order (path probability under the drafter's / Weaver's scores, shallower first among ties) make every
  prefix a subtree. A prefix's expected committed length is ``1 + Σ_d r_d`` with
  ``r_d = min(r_{d-1}, c_d · Σ_{nodes of depth d} exp(path log q))`` (``r_0 = 1``): the chance to reach depth d,
  where ``c_d`` corrects the scores (which are not acceptance probabilities) by the decayed ratio of observed to
  predicted reach at that depth, its prior the correction of the depth above (:func:`depth_factors`: a depth no tree
  has held yet is rated as the deepest one seen, not by the drafter's raw scores).
- **Policy** (:func:`steady_rates`, :func:`pick_size`, :func:`pick_drafted`, :class:`AutoBudget`): the size maximising
  expected length / step time, or 0 (AR). The tree already drafted in a step is then cut to the prefix worth most
  beyond its verify time at that best rate, which may be the root alone; when that is the root alone and AR won, the
  next steps do not draft until the next look at the drafter (their number doubling while AR keeps winning, in units
  of a draft's time in AR steps).
  :func:`choose_on_device` makes the same choice on the device for the fused auto steps (:mod:`.fused`).

Any tree a step verifies is a function of what was committed before it, so every acceptance rule stays lossless.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..accept import accept_greedy
from ..options import BudgetPolicy, StepOptions, TreePolicy
from ..output_dir import cache_root
from ..target import TargetAdapter
from ..tree import Tree, ancestor_mask_of, default_tree_mode, max_tree_budget, subtree
from ..validation import is_int
from .drafting import DFlashRunner, EagerProposer
from .step_cache import capture_flags, static_buckets, static_draft

CACHE_FILE = "step_costs.json"
CALIBRATION_VERSION = "4"  # (bump when what is timed, or how times become costs, changes: older entries are then
# measured again)


@dataclass(frozen=True)
class CostTable:
    """Measured milliseconds of one step's parts.

    Attributes:
        verify_ms: ``(drafts, ms)`` pairs, ascending: verify + greedy accept + commit of a tree of that many draft
            nodes and the root (0: an AR step).
        propose_ms: draft + tree build at the largest size, the tree read by the host.
        fields: what it was measured on (``(name, value)`` pairs; the cache key is their hash).
        source: ``"measured"``, ``"cache"`` or ``"given"``.
    """

    verify_ms: tuple[tuple[int, float], ...]
    propose_ms: float
    fields: tuple[tuple[str, str], ...] = ()
    source: str = "given"

    def verify(self, drafts: int) -> float:
        """Verify + accept + commit ms at ``drafts`` nodes, linear between the measured sizes (clamped outside)."""
        points = self.verify_ms
        if drafts <= points[0][0]:
            return points[0][1]
        for (a, ta), (b, tb) in zip(points, points[1:]):
            if drafts <= b:
                return ta + (tb - ta) * (drafts - a) / (b - a)
        return points[-1][1]

    def step_ms(self, drafts: int) -> float:
        """A whole step with ``drafts`` draft nodes; 0: an AR step, which drafts nothing."""
        return self.verify(0) if drafts == 0 else self.propose_ms + self.verify(drafts)

    def as_dict(self) -> dict:
        return {"verify_ms": {str(k): round(v, 4) for k, v in self.verify_ms}, "propose_ms": round(self.propose_ms, 4),
                "fields": dict(self.fields), "source": self.source}

    @classmethod
    def from_dict(cls, entry: dict, source: str) -> CostTable:
        verify = tuple(sorted((int(k), float(v)) for k, v in entry["verify_ms"].items()))
        return cls(verify, float(entry["propose_ms"]), tuple(sorted(entry["fields"].items())), source)


# ------------------------------------------------------------------------------------------------------------ value


def best_first(parents: list[int], logq: list[float]) -> list[tuple[int, int, float]]:
    """``(node, depth, path probability)`` of a tree's draft nodes, most probable first, shallower first among ties
    (a node's path is never more probable than its parent's: every prefix is a subtree). Padding roots are left out."""
    score, depth = [0.0] * len(parents), [0] * len(parents)
    for i in range(1, len(parents)):
        p = parents[i]
        score[i] = score[p] + logq[i] if p >= 0 else -math.inf
        depth[i] = depth[p] + 1 if p >= 0 else 0
    order = sorted((i for i in range(1, len(parents)) if score[i] > -math.inf), key=lambda i: (-score[i], depth[i], i))
    return [(i, depth[i], math.exp(score[i])) for i in order]


def reach_sums(nodes: list[tuple[int, int, float]]) -> list[float]:
    """Per depth (index 0: the root), the summed path probability of ``nodes``: the drafter's chance to reach it."""
    sums = [1.0] + [0.0] * max((d for _, d, _ in nodes), default=0)
    for _, d, p in nodes:
        sums[d] += p
    return sums


def expected_length(sums: list[float], factors: list[float]) -> float:
    """Expected committed tokens of a step (bonus included): ``1 + Σ_d r_d``, ``r_d = min(r_{d-1}, c_d · sums[d])``."""
    reach = total = 1.0
    for d in range(1, len(sums)):
        reach = min(reach, (factors[d] if d < len(factors) else 1.0) * sums[d])
        total += reach
    return total


def expected_lengths(nodes: list[tuple[int, int, float]], sizes, factors: list[float]) -> list[float]:
    """:func:`expected_length` of the best-first prefix of each size in ``sizes`` (0: 1, an AR step); the reach sums
    grow node by node, once for all sizes."""
    sums, taken, by_size = [1.0], 0, {}
    for k in sorted(set(sizes)):
        for _, d, p in nodes[taken:k]:
            sums.extend([0.0] * (d + 1 - len(sums)))
            sums[d] += p
        taken = max(taken, min(k, len(nodes)))
        by_size[k] = expected_length(sums, factors) if k else 1.0
    return [by_size[k] for k in sizes]


def depth_factors(observed: torch.Tensor, predicted: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
    """``c_d`` per depth (index 0: 1) from the decayed sums of observed and predicted reach and the prior's weight
    ``W_d`` (one step at first, decayed as the depth is observed): ``c_d = (O_d + W_d · c_{d-1}) / (P_d + W_d)``, so
    a depth no tree has held yet is rated as the one above it. In closed form (device ops, no host read): ``c_d =
    Π_{i≤d} b_i + Σ_{j≤d} a_j Π_{j<i≤d} b_i`` with ``a = O / (P + W)``, ``b = W / (P + W)``."""
    a, b = observed / (predicted + prior), prior / (predicted + prior)
    depth = torch.arange(a.shape[0], device=a.device)
    a, b = torch.where(depth == 0, 1.0, a), torch.where(depth == 0, 1.0, b)  # (c_0 = 1)
    logs = b.log().cumsum(0)
    below = depth[:, None] >= depth[None, :]  # [d, j]: j ≤ d
    carry = torch.where(below & (depth[None, :] > 0), logs[:, None] - logs[None, :], float("-inf")).exp()
    return carry @ a + logs.exp()


#: the least weight the prior keeps (its logarithm stays finite in :func:`depth_factors`)
PRIOR_FLOOR = 1e-6


def calibrate(observed: torch.Tensor, predicted: torch.Tensor, prior: torch.Tensor, sums: torch.Tensor, accepted,
              decay: float) -> None:
    """One drafting step's update, in place, over the depths its tree held (``sums[d] = S_d > 0``, d ≥ 1): ``O_d ←
    δ^S_d O_d + [accepted − 1 ≥ d]``, ``P_d ← δ^S_d P_d + S_d``, ``W_d ← δ^S_d W_d`` (``accepted``: committed
    tokens, root included; device ops). A step forgets in proportion to the evidence it brings: a deep depth, which
    a step reaches rarely, keeps about as much predicted reach (``1 / (1 − δ)``) in its memory as a shallow one,
    instead of ten steps that may hold no acceptance there at all."""
    depth = torch.arange(observed.shape[0], device=observed.device)
    held = (sums > 0) & (depth >= 1)
    rate = torch.pow(decay, sums.to(observed.dtype))
    observed.copy_(torch.where(held, rate * observed + (accepted - 1 >= depth).to(observed.dtype), observed))
    predicted.copy_(torch.where(held, rate * predicted + sums, predicted))
    prior.copy_(torch.where(held, (rate * prior).clamp(min=PRIOR_FLOOR), prior))


# ----------------------------------------------------------------------------------------------------------- policy


def steady_rates(sizes, lengths: list[float], costs: CostTable, available: int | None = None) -> list[float]:
    """Expected tokens per ms of each size in ``sizes`` as a steady choice (draft time included); a size past the
    ``available`` nodes costs what that many do."""
    return [length / costs.step_ms(k if available is None else min(k, available)) for k, length in zip(sizes, lengths)]


def pick_size(sizes, lengths: list[float], costs: CostTable, available: int | None = None) -> int:
    """The size in ``sizes`` (ascending) with the most expected tokens per ms (the smaller among equals)."""
    rates = steady_rates(sizes, lengths, costs, available)
    return sizes[rates.index(max(rates))]


def pick_drafted(sizes, lengths: list[float], costs: CostTable, available: int | None = None,
                 rate: float | None = None) -> int:
    """The size to verify once the tree is drafted (its draft time spent): the most expected tokens beyond what the
    verify's time would give at the best steady ``rate`` (default: :func:`steady_rates`' best), so that a tree worth
    less than drafting it can still be worth verifying rather than thrown away for an AR step. Among equals the larger
    size, at most ``available``."""
    clamp = (lambda k: k) if available is None else (lambda k: min(k, available))  # noqa: E731
    rate = max(steady_rates(sizes, lengths, costs, available)) if rate is None else rate
    # (among equals the larger: nodes the model rates at nothing, at a cost the table cannot tell apart, are free)
    return max((length - rate * costs.verify(clamp(k)), clamp(k)) for k, length in zip(sizes, lengths))[1]


def choose_on_device(parents: torch.Tensor, logq: torch.Tensor, factors: torch.Tensor, sizes: torch.Tensor,
                     verify_ms: torch.Tensor, propose_ms: float, mask: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:meth:`AutoBudget.choose`'s choice on the device, at fixed shapes (no host read: a captured step holds it).

    Args:
        parents, logq: ``[N]`` a rooted tree (root first; padding roots: parent -1, ``logq`` -inf).
        factors: ``[D]`` fp64 ``c_d`` (:func:`depth_factors`); sizes: ``[S]`` ascending candidate draft counts;
        verify_ms: ``[max size + 1]`` fp64 :meth:`CostTable.verify` of every draft count; propose_ms: as the table's.
        mask: the tree's ancestor mask (:func:`~modeling_weaver.tree.ancestor_mask_of`), when the caller has it.
    Returns:
        ``choice [3]`` — the index in ``sizes`` of the smallest size holding the chosen prefix, whether AR is the
        best steady size (draft time counted: :meth:`AutoBudget.steady` decides from it whether the next steps draft),
        the chosen number of drafts; ``rank [N]`` — each node's
        place in the best-first order (root -1, padding roots ≥ the drafts there are): the prefix is ``rank <
        choice[2]``; ``sums [D]`` fp64 — that prefix's reach sums per depth (for :func:`calibrate`).
    """
    mask = ancestor_mask_of(parents) if mask is None else mask
    real = mask[:, 0]
    depth = mask.sum(1) - 1
    n = parents.shape[0]
    nodes = torch.arange(n, device=parents.device)
    score = torch.where(mask & (nodes[None] > 0), logq.double()[None], 0.0).sum(1)  # (the root's own logq is no step)
    score = torch.where(real, score, float("-inf"))
    # best-first: path score descending, shallower first, then the tree's order; the root first of all
    by_depth = torch.sort(depth, stable=True).indices
    key = torch.where(nodes == 0, float("inf"), score)[by_depth]
    order = by_depth[torch.sort(-key, stable=True).indices]
    rank = torch.empty_like(nodes).scatter_(0, order, nodes) - 1
    drafts = real & (nodes > 0)
    p = torch.where(drafts, score.exp(), 0.0)
    available = drafts.sum()
    # per size: the reach sums of its prefix per depth, then E[L] = 1 + Σ_d min over the depths above of c_d · S_d
    kept = (drafts[None] & (rank[None] < sizes[:, None])).double()  # [S, N]
    onehot = depth[:, None].clamp(max=factors.shape[0] - 1) == torch.arange(factors.shape[0], device=depth.device)
    sums = kept @ torch.where(onehot, p[:, None], 0.0)  # [S, D]
    scaled = (factors[None] * sums)[:, 1:]
    reach = torch.cat([scaled.new_ones(scaled.shape[0], 1), scaled], 1).cummin(1).values
    lengths = 1.0 + reach[:, 1:].sum(1)
    drafted = torch.minimum(sizes, available)
    verify = verify_ms[drafted]
    rates = lengths / torch.where(drafted > 0, verify + propose_ms, verify)
    # (indices as one-element tensors: a 0-d index would be read on the host, which a capture refuses)
    steady = rates.argmax().view(1)  # (the first among equals: the smaller size)
    gain = lengths - rates[steady] * verify
    pick = (gain.shape[0] - 1 - gain.flip(0).argmax()).view(1)  # (the last among equals: the larger size)
    size = drafted[pick]
    choice = torch.cat([(sizes < size).sum().view(1), (sizes[steady] == 0).long(), size])
    return choice, rank, sums[pick][0]


def candidate_sizes(policy: BudgetPolicy, target, device) -> tuple[int, ...]:
    """The policy's sizes up to its largest tree on ``device`` and the target's bound (the largest is built)."""
    if not policy.sizes or any(not is_int(s) or s < 0 for s in policy.sizes):
        raise ValueError(f"BudgetPolicy.sizes must be draft counts >= 0 (0: an AR step), got {policy.sizes!r}")
    if not 0 < policy.decay <= 1:
        raise ValueError(f"BudgetPolicy.decay must be in (0, 1], got {policy.decay!r}")
    if not is_int(policy.skip_after) or policy.skip_after < 1:
        raise ValueError(f"BudgetPolicy.skip_after must be a number of steps >= 1, got {policy.skip_after!r}")
    if policy.look_ahead is not None and (not is_int(policy.look_ahead) or policy.look_ahead < 0):
        raise ValueError(f"BudgetPolicy.look_ahead must be a number of drafts >= 0 or None, got {policy.look_ahead!r}")
    if not is_int(policy.look_ahead_gap) or policy.look_ahead_gap < 0:
        raise ValueError(f"BudgetPolicy.look_ahead_gap must be a number of steps >= 0, got {policy.look_ahead_gap!r}")
    if not is_int(policy.dense_costs) or policy.dense_costs < 0:
        raise ValueError(f"BudgetPolicy.dense_costs must be a draft count >= 0, got {policy.dense_costs!r}")
    cap = min(policy.max_size_on(device), max_tree_budget(target, device))
    sizes = tuple(sorted({s for s in policy.sizes if s <= cap}))
    return sizes if any(sizes) else (*sizes, cap)  # (something to build: the largest tree that fits)


def auto_sizes(tree_budget: int | str, policy: BudgetPolicy | None, target, device):
    """``(budget, policy, sizes)``: for ``tree_budget="auto"`` the largest candidate size, the policy (default
    :class:`~modeling_weaver.options.BudgetPolicy`) and its candidate sizes; else the budget as given, no policy."""
    if tree_budget == "auto":
        policy = policy or BudgetPolicy()
        sizes = candidate_sizes(policy, target, device)
        return max(sizes), policy, sizes
    if policy is not None:
        raise ValueError(f'budget_policy applies to tree_budget="auto" only, got tree_budget={tree_budget!r}')
    return tree_budget, None, ()


class AutoBudget:
    """One generation's adaptive tree size, the seam the split steps call each step: :meth:`drafts` (draft this
    step?), :meth:`choose` (cut the drafted tree to the chosen prefix), :meth:`observe` (the accepted length, for the
    calibration). :meth:`report` says what it used.

    With ``look_ahead`` > 0 (``BudgetPolicy.look_ahead_on``, given a resizable proposer: eager steps), the tree is
    built at :attr:`build` drafts instead of the largest size: the size chosen last, and on look-ahead steps
    ``look_ahead`` past it (the largest at first and after steps without drafting). A steady choice below the largest
    then does not pay each step for drafting and building more. A look-ahead whose extra drafts are chosen looks
    ahead again the next step; one whose are not waits twice as many steps as the last before the next, up to
    ``look_ahead_gap`` (``BudgetPolicy.look_ahead_gap``); a choice below the last looks ahead the next step."""

    def __init__(self, policy: BudgetPolicy, costs: CostTable, sizes: tuple[int, ...], max_depth: int,
                 look_ahead: int = 0):
        self.policy, self.costs, self.sizes = policy, costs, sizes
        self.look_ahead, self.largest = look_ahead, max(sizes)
        # the drafts the next tree is built with (None: the proposer's own budget, the largest size)
        self.build = self.largest if look_ahead else None
        self.last = self.gap = self.wait = 0  # the size chosen last; steps between look-aheads now, and to the next
        # decayed sums of observed and predicted reach per depth and the prior's weight: host floats (a step's few
        # depths cost less as a loop than as ~30 small tensor ops); fused steps replace them by their device buffers
        self.observed = [0.0] * (max_depth + 1)
        self.predicted = [0.0] * (max_depth + 1)
        self.prior = [1.0] * (max_depth + 1)
        self.skip = self.backoff = self.streak = 0  # AR steps still to skip, their count's unit, AR verdicts in a row
        self.reach: list[float] | None = None  # the verified tree's predicted reach per depth (None: an AR step)

    def factors(self) -> list[float]:
        """``c_d`` per depth (index 0: 1): :func:`depth_factors`, on the host by its recurrence."""
        if torch.is_tensor(self.observed):  # (fused steps' device buffers)
            return depth_factors(self.observed, self.predicted, self.prior).tolist()
        factors = [1.0]
        for o, p, w in zip(self.observed[1:], self.predicted[1:], self.prior[1:]):
            factors.append((o + w * factors[-1]) / (p + w))
        return factors

    def drafts(self) -> bool:
        """Whether this step drafts (False: an AR step, after the policy chose AR)."""
        self.reach = None
        if self.skip:
            self.skip -= 1
            return False
        return True

    def choose(self, tree: Tree) -> Tree:
        """The best-first prefix of ``tree`` of the chosen size (the root alone: an AR step). Whether the next steps
        draft follows the steady rule (draft time counted); what this step verifies, the drafted one (it is spent)."""
        nodes = best_first(tree.parents.tolist(), tree.logq.tolist())
        lengths = expected_lengths(nodes, self.sizes, self.factors())
        rates = steady_rates(self.sizes, lengths, self.costs, len(nodes))
        best = max(rates)
        size = pick_drafted(self.sizes, lengths, self.costs, len(nodes), rate=best)
        self.steady(self.sizes[rates.index(best)] == 0, min(size, len(nodes)) == 0)
        if self.look_ahead and (size or self.skip):
            self.resize(size)
        if size == 0:
            self.reach = None
            return subtree(tree, [])
        kept = nodes[:size]
        self.reach = reach_sums(kept)
        if len(kept) == len(tree) - 1:
            return tree
        return subtree(tree, [i for i, _, _ in kept])

    def resize(self, size: int) -> None:
        """The next tree's :attr:`build` once this step chose ``size`` drafts (see the class)."""
        if self.skip:  # (after steps without a draft: the largest tree again, as at first)
            self.build, self.last, self.gap, self.wait = self.largest, 0, 0, 0
            return
        if self.build > self.last:  # a look-ahead step
            grew = size > self.last
            self.gap = 0 if grew else min(max(1, 2 * self.gap), self.policy.look_ahead_gap)
            self.wait = self.gap
        else:  # (a choice below the last: look ahead at once, to where it was, as one step's dip is common)
            self.wait = 0 if size < self.last else self.wait - 1
        self.last = size
        self.build = min(size + (self.look_ahead if self.wait <= 0 else 0), self.largest)

    def steady(self, ar: bool, cut: bool) -> None:
        """Whether the next steps draft, once a step's choice is known (``ar``: AR wins as a steady choice, draft time
        counted; ``cut``: the drafted tree was cut to its root). After ``policy.skip_after`` such AR verdicts in a
        row, or one whose drafted tree was not worth its verify either, a few AR steps without drafting, more while
        AR keeps winning (in units of a draft's time in AR steps: a probe then costs at most 1 / backoff of the AR
        time). One step's expected length is a noisy estimate, and skipping drafts on a drafter that is right more
        often than it says loses (BENCHMARKS, the CPU auto runs): a single verdict skips only when even the drafted
        tree is not worth verifying."""
        self.streak = self.streak + 1 if ar else 0
        if ar and (cut or self.streak >= self.policy.skip_after):
            self.backoff = min(max(1, 2 * self.backoff), self.policy.max_backoff)
            self.skip = self.backoff * max(1, round(self.costs.propose_ms / self.costs.step_ms(0)))
        elif not ar:
            self.backoff = 0

    def observe(self, accepted: int) -> None:
        """The committed length (root included) of the step whose tree :meth:`choose` gave."""
        if self.reach is None:
            return
        # calibrate()'s update on the host
        for d, held in enumerate(self.reach[1:len(self.observed)], start=1):
            if held > 0:
                rate = self.policy.decay ** held
                self.observed[d] = rate * self.observed[d] + (accepted - 1 >= d)
                self.predicted[d] = rate * self.predicted[d] + held
                self.prior[d] = max(rate * self.prior[d], PRIOR_FLOOR)

    def report(self) -> dict:
        return {"costs": self.costs.as_dict(), "sizes": list(self.sizes),
                "depth_factors": [round(f, 4) for f in self.factors()[1:]]}


# ------------------------------------------------------------------------------------------------------ calibration


def device_name(device) -> str:
    """The GPU's name, or the CPU's model with its cores and torch's threads (what a step's time depends on)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{device.type}: {model}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_signature(model) -> str:
    """The hash of a model's config (its name and version left out) and module types (prepacked or int8 linears
    run at other speeds)."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    return _digest([config, sorted({type(m).__name__ for m in model.modules()})])


def cost_fields(target, runner: DFlashRunner, weaver, mode: str, sizes: tuple[int, ...], tree_policy: TreePolicy,
                step_options: StepOptions, policy: BudgetPolicy, step: str = "eager") -> dict:
    """What a :class:`CostTable` depends on: the cache key is their hash."""
    param = next(target.parameters())
    return {"version": CALIBRATION_VERSION, "device": device_name(param.device), "step": step,
            "target": type(target).__name__, "target_signature": model_signature(target), "dtype": str(param.dtype),
            "drafter_signature": model_signature(runner.drafter), "drafter_dtype": str(runner.dtype),
            "weaver_signature": model_signature(weaver) if mode == "weaver" else None, "mode": mode,
            "sizes": list(sizes), "tree_policy": repr(tree_policy) if mode == "weaver" else None,
            "step_options": repr(step_options), "context": policy.calibration_context}


def _dummy_tree(drafts: int, depth: int, vocab: int, device, generator: torch.Generator) -> Tree:
    """A tree of ``drafts`` nodes and the root: a chain to ``depth``, the other nodes hung round-robin on it."""
    chain = min(drafts, depth)
    parents = [-1] + list(range(chain)) + [i % chain for i in range(drafts - chain)]
    tokens = torch.randint(0, vocab, (drafts + 1,), generator=generator).tolist()
    return Tree.from_lists(tokens, parents, device=device)


def _step_parts(target, runner: DFlashRunner, weaver, mode: str, sizes: tuple[int, ...], tree_policy: TreePolicy,
                step_options: StepOptions, max_length: int, step: str):
    """The verifier and the largest size's proposer that a generation of ``step`` (a loop ``target_step``) runs:
    eager ones on fresh caches, or the fixed-shape steps the generation itself will use (kept per model: a later
    generation resets them, and on CUDA the graphs captured here are the ones it replays)."""
    depth = runner.block_size - 1
    if step == "eager":
        verifier = TargetAdapter(target, max_length=max_length, feature_layer_ids=runner.feature_layer_ids,
                                 max_tree_depth=depth, options=step_options)
        proposer = EagerProposer(DFlashRunner(runner.drafter, target, step_options), mode, max(sizes), weaver, target,
                                 tree_policy)
        return verifier, proposer
    flags = capture_flags(step, next(target.parameters()).device)
    verifier = static_buckets(target, max_length, [s + 1 for s in sizes], runner.feature_layer_ids, **flags,
                              max_tree_depth=depth, options=step_options)
    proposer = static_draft(runner.drafter, target, max_length, flags["capture"], options=step_options).proposer(
        mode, max(sizes), weaver if mode == "weaver" else None, compile=flags["compile"], policy=tree_policy)
    return verifier, proposer


@torch.no_grad()
def measure_costs(target, runner: DFlashRunner, weaver, mode: str, sizes: tuple[int, ...], tree_policy: TreePolicy,
                  step_options: StepOptions, policy: BudgetPolicy,
                  step: str = "eager") -> tuple[tuple[tuple[int, float], ...], float]:
    """Time a step's parts on dummy inputs, with the verifier and proposer of ``step`` (a loop ``target_step``):
    verify + accept + commit at each size, draft + tree at the largest (the generation's own caches are untouched,
    or reset before it starts). Returns ``(verify_ms pairs, propose_ms)``.

    Round-robin over the parts, one warm-up round, then the median of ``policy.calibration_reps`` rounds: a slow
    spell of a shared machine slows every part alike. The verify costs then follow :func:`resolved_costs`."""
    device = next(target.parameters()).device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    reps, context, depth = policy.calibration_reps, policy.calibration_context, runner.block_size - 1
    vocab = target.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    rounds = reps + 1
    adapter, proposer = _step_parts(target, runner, weaver, mode, sizes, tree_policy, step_options,
                                    context + rounds * len(sizes) + max(sizes) + 2, step)
    prefilled = adapter.prefill(torch.randint(0, vocab, (context,), generator=generator).to(device))
    features, last = prefilled.features, prefilled.hidden[-1]
    proposer.propose(0, features, context, last)  # the prompt's context, once
    drafted = iter(range(1, rounds + 1))

    def verify_step(tree: Tree):
        accept_greedy(tree, adapter.verify(tree).logits.float())
        adapter.commit([0])  # (each timed step commits its root)

    def propose():
        proposer.propose(0, features[-1:], context + next(drafted), last).tree.logq.tolist()  # (the host reads it)

    parts = {size: (lambda tree=_dummy_tree(size, depth, vocab, device, generator): verify_step(tree))
             for size in sizes}
    parts["propose"] = propose
    times: dict = {key: [] for key in parts}
    for round_ in range(rounds):
        for key, part in parts.items():
            sync()
            start = time.perf_counter()
            part()
            sync()
            if round_:  # (the first round warms up)
                times[key].append(1e3 * (time.perf_counter() - start))
    return resolved_costs(sizes, [times[size] for size in sizes]), statistics.median(times["propose"])


def warm_sizes(target, drafter, weaver=None, mode: str | None = None, policy: BudgetPolicy | None = None,
               tree_policy: TreePolicy | None = None, step_options: StepOptions | None = None) -> None:
    """Verify every size an eager ``tree_budget="auto"`` generation may choose once, on dummy inputs (one round of
    :func:`measure_costs`, nothing cached): a size's first verify in a process pays one-time costs (on a CPU, oneDNN
    builds each linear's primitive for a new row count), which a timed comparison keeps out of its timings as it does
    for a fixed budget's single size. ``mode`` None: the generation's default (:func:`~..tree.default_tree_mode`)."""
    policy = policy or BudgetPolicy()
    tree_policy, step_options = tree_policy or TreePolicy(), step_options or StepOptions()
    device = next(target.parameters()).device
    sizes = policy.measured(policy.choices(candidate_sizes(policy, target, device), "eager"), "eager")
    mode = mode or default_tree_mode(device, weaver)
    runner = DFlashRunner(drafter, target, step_options)
    measure_costs(target, runner, weaver, mode, sizes, tree_policy, step_options,
                  dataclasses.replace(policy, calibration_reps=1))


def resolved_costs(sizes: tuple[int, ...], times: list[list[float]]) -> tuple[tuple[int, float], ...]:
    """``(size, ms)`` verify costs from each ascending size's timed rounds: the median, lowered to the least at any
    larger size (noise only adds time, and a larger tree never costs less); then a size that the rounds cannot tell
    from the next one (their medians closer than the sum of their rounds' median absolute deviations) costs what the
    next one does, so that a difference within the noise never buys a smaller tree (on a CPU, a verify's rows cost in
    steps of their GEMMs' row blocks: the sizes of a block cost alike)."""
    medians = [statistics.median(ms) for ms in times]
    spread = [statistics.median(abs(t - m) for t in ms) for ms, m in zip(times, medians)]
    least = [min(medians[i:]) for i in range(len(sizes))]
    costs = [least[i + 1] if i + 1 < len(sizes) and least[i + 1] - least[i] <= spread[i] + spread[i + 1] else least[i]
             for i in range(len(sizes))]
    return tuple(zip(sizes, costs))


def _read(path: Path) -> dict:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def step_costs(target, runner, weaver, mode: str, sizes: tuple[int, ...], tree_policy: TreePolicy,
               step_options: StepOptions, policy: BudgetPolicy, step: str = "eager") -> CostTable:
    """The :class:`CostTable` of this generation's setup (``step``: its ``target_step``): ``policy.costs`` if given;
    else the cached one (file :data:`CACHE_FILE` in ``policy.cache_dir`` or the cache folder) unless
    ``policy.recalibrate``; else measured (:func:`measure_costs`, seconds) and cached. Entries of other setups in the
    file are kept."""
    if policy.costs is not None:
        return policy.costs
    if not isinstance(runner, DFlashRunner):
        raise ValueError('tree_budget="auto" measures its costs with a DFlash drafter: with another drafting runner, '
                         "give BudgetPolicy(costs=CostTable(...))")
    sizes = policy.measured(sizes, step)
    fields = cost_fields(target, runner, weaver, mode, sizes, tree_policy, step_options, policy, step)
    key = _digest(fields)
    path = Path(policy.cache_dir) if policy.cache_dir is not None else cache_root()
    path = path / CACHE_FILE
    entry = _read(path).get(key)
    if not policy.recalibrate and isinstance(entry, dict) and entry.get("fields") == fields:
        try:
            return CostTable.from_dict(entry, "cache")
        except (KeyError, TypeError, ValueError):
            pass  # (a damaged entry: measured again)
    verify, propose = measure_costs(target, runner, weaver, mode, sizes, tree_policy, step_options, policy, step)
    table = CostTable(verify, propose, tuple(sorted(fields.items())), "measured")
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = _read(path)  # (again: another process may have added entries meanwhile)
    entries[key] = {**table.as_dict(), "fields": fields}
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".part", delete=False) as f:
        json.dump(entries, f, indent=1, sort_keys=True)
    os.replace(f.name, path)  # (atomic: a reader sees the old file or the new one)
    return table


__all__ = ["AutoBudget", "CostTable", "auto_sizes", "best_first", "calibrate", "candidate_sizes", "choose_on_device",
           "depth_factors", "expected_length",
           "expected_lengths", "measure_costs", "pick_drafted", "pick_size", "reach_sums", "resolved_costs",
           "steady_rates", "step_costs", "warm_sizes"]

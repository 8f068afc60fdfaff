"""tree_budget="auto" (docs/DESIGN.md §12): the policy on synthetic cost / value tables, best-first prefixes as
subtrees, greedy identity and sampling exactness with auto on the tiny targets, and the calibration cache."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_generate import (BLOCK, OracleRunner, make_drafters, prompts, reference, three_token_distribution,
                           toy_vocab_pair)
from tiny_targets import TINY_TARGETS, VOCAB
from transformers.generation import LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList

from modeling_weaver import BudgetPolicy, WeaverModel
from modeling_weaver.decoding import budget as budget_module
from modeling_weaver.decoding import step_cache
from modeling_weaver.decoding.verify import BucketedTarget
from modeling_weaver.decoding.adaptive import FusedAutoSteps
from modeling_weaver.decoding.budget import (CACHE_FILE, AutoBudget, CostTable, best_first, calibrate,
                                             candidate_sizes, choose_on_device, depth_factors, expected_length,
                                             expected_lengths, pick_drafted, pick_size, reach_sums, resolved_costs,
                                             step_costs)
from modeling_weaver.decoding.drafting import DFlashRunner, StaticDraft
from modeling_weaver.generate import _decode, generate, speculative_generate
from modeling_weaver.options import StepOptions, TreePolicy
from modeling_weaver.target import TargetAdapter, text_config
from modeling_weaver.tree import Tree, ddtree, default_tree_mode, subtree, weaver_tree

SIZES = (0, 4, 8, 16, 32)
# verify grows with the tree as on a CPU (a 32-node tree costs 8 AR steps), drafting is cheap
STEEP = CostTable(((0, 10.0), (4, 20.0), (8, 30.0), (16, 50.0), (32, 80.0)), 2.0)
# verify barely grows with the tree (a GPU's memory-bound step)
FLAT = CostTable(((0, 10.0), (4, 10.2), (8, 10.4), (16, 10.8), (32, 11.5)), 1.0)
# in between: AR and trees both win at times with tiny drafters
MIXED = CostTable(((0, 10.0), (4, 11.0), (8, 12.0), (16, 14.0), (32, 18.0)), 2.0)


def bushy(p_child: float, depth: int = 7, width: int = 4) -> Tree:
    """``width`` chains of ``depth``: the first with probability ``p_child`` per token, the others sharing the rest."""
    tokens, parents, logq = [0], [-1], [0.0]
    for w in range(width):
        p = p_child if w == 0 else (1 - p_child) / (width - 1)
        parent = 0
        for d in range(depth):
            tokens.append(1 + w)
            parents.append(parent)
            logq.append(math.log(p if d == 0 else p_child))
            parent = len(tokens) - 1
    return Tree.from_lists(tokens, parents, logq)


def test_ar_when_verify_is_expensive_and_the_drafter_unsure():
    sizer = AutoBudget(BudgetPolicy(), STEEP, SIZES, BLOCK - 1)
    chosen = sizer.choose(bushy(0.2))
    assert len(chosen) == 1 and int(chosen.parents[0]) == -1  # the root alone: an AR step
    assert sizer.reach is None
    # the next step skips drafting, then one drafts again; a second AR choice skips two, and so on up to the cap
    assert [sizer.drafts() for _ in range(2)] == [False, True]
    sizer.choose(bushy(0.2))
    assert [sizer.drafts() for _ in range(3)] == [False, False, True]
    sizer = AutoBudget(BudgetPolicy(), CostTable(STEEP.verify_ms, 30.0), SIZES, BLOCK - 1)
    sizer.choose(bushy(0.2))  # a draft costs three AR steps: three times the AR steps before the next look
    assert [sizer.drafts() for _ in range(4)] == [False, False, False, True]
    sizer = AutoBudget(BudgetPolicy(max_backoff=0), STEEP, SIZES, BLOCK - 1)
    sizer.choose(bushy(0.2))
    assert sizer.drafts()  # no backoff: every step drafts


def test_a_large_tree_when_verify_is_cheap_and_the_drafter_sure():
    sizer = AutoBudget(BudgetPolicy(), FLAT, SIZES, BLOCK - 1)
    assert sizer.choose(bushy(0.9)).num_drafts >= 16
    wide = bushy(0.7, width=5)  # the side chains' 0.075 per token are worth verifying too when verify is ~free
    assert AutoBudget(BudgetPolicy(), CostTable(((0, 10.0), (32, 10.1)), 1.0), SIZES, 7).choose(wide).num_drafts == 32
    assert AutoBudget(BudgetPolicy(), STEEP, SIZES, BLOCK - 1).choose(bushy(0.9)).num_drafts in (4, 8)
    # a confident chain on the steep table: a small tree, never AR
    assert pick_size(SIZES, [1.0, 3.0, 4.0, 5.0, 6.0], STEEP) == 4
    assert pick_size(SIZES, [1.0, 3.0, 4.0, 5.0, 6.0], FLAT) == 32
    assert pick_size(SIZES, [1.0, 1.05, 1.1, 1.1, 1.1], STEEP) == 0


def test_a_drafted_tree_is_verified_when_it_beats_its_verify_time():
    """A CPU-like table (a draft costs 0.6 AR steps, a 8-node verify 1.4): at an expected 1.7 tokens, steady drafting
    loses to AR (1.7 tokens in 2.0 AR steps); but the tree this step has drafted already gives 1.55–1.7 tokens for
    1.2–1.4 AR steps of verify: it is verified, not thrown away for an AR step, and the next steps keep drafting (a
    tree worth its verify is no sign of a hopeless drafter; only a tree cut to its root is)."""
    cpu = CostTable(((0, 52.6), (4, 64.7), (8, 73.7), (16, 90.0), (32, 111.4)), 32.0)
    lengths = [1.0, 1.55, 1.7, 1.75, 1.78]
    assert pick_size(SIZES, lengths, cpu) == 0
    assert pick_drafted(SIZES, lengths, cpu) == 4  # 0.32 tokens beyond its verify time, 8 nodes: 0.30
    assert pick_drafted(SIZES, [1.0, 1.1, 1.15, 1.2, 1.2], cpu) == 0  # too unsure even with the draft spent
    assert pick_drafted(SIZES, [1.0, 3.0, 4.0, 5.0, 6.0], STEEP) == 4  # where drafting pays, the steady choice
    assert pick_drafted(SIZES, [1.0, 3.0, 4.0, 5.0, 6.0], FLAT) == 32
    plateau = CostTable(((0, 10.0), (4, 12.0), (5, 12.0), (6, 14.0)), 1.0)  # 4 and 5 drafts cost alike
    assert pick_drafted((0, 4, 5, 6), [1.0, 2.0, 2.0, 2.0], plateau) == 5  # a node worth nothing, for nothing: kept
    assert pick_drafted((0, 4, 5, 6), [1.0, 2.0, 2.0, 2.0], plateau, available=4) == 4  # (no more nodes drafted)
    sizer = AutoBudget(BudgetPolicy(), cpu, SIZES, BLOCK - 1)
    sizer.factors = lambda: [1.0] * BLOCK  # noqa: E731 (the tree's scores taken as they are)
    tree = bushy(0.45, width=1)  # one chain: 1.78 tokens expected from 4 nodes
    nodes = best_first(tree.parents.tolist(), tree.logq.tolist())
    lengths = expected_lengths(nodes, SIZES, [1.0] * BLOCK)
    assert pick_size(SIZES, lengths, cpu, len(nodes)) == 0 and pick_drafted(SIZES, lengths, cpu, len(nodes)) > 0
    chosen = sizer.choose(tree)
    assert chosen.num_drafts == pick_drafted(SIZES, lengths, cpu, len(nodes)) and sizer.reach is not None
    assert [sizer.drafts() for _ in range(2)] == [True, True] and sizer.backoff == 0


def test_ar_verdicts_in_a_row_skip_drafting_even_when_each_tree_is_worth_its_verify():
    """The CPU-like table of the test above: AR wins steadily but each drafted tree is still verified; after
    ``skip_after`` such verdicts in a row the next steps skip drafting, and a verdict for drafting resets the count."""
    cpu = CostTable(((0, 52.6), (4, 64.7), (8, 73.7), (16, 90.0), (32, 111.4)), 32.0)
    sizer = AutoBudget(BudgetPolicy(skip_after=3), cpu, SIZES, BLOCK - 1)
    sizer.factors = lambda: [1.0] * BLOCK  # noqa: E731
    unsure, sure = bushy(0.45, width=1), bushy(0.9)
    for _ in range(2):
        assert sizer.choose(unsure).num_drafts > 0 and sizer.drafts()  # verified, and the next step drafts
    assert sizer.choose(sure).num_drafts > 0 and sizer.streak == 0 and sizer.drafts()
    for _ in range(2):
        sizer.choose(unsure)
        assert sizer.drafts()
    sizer.choose(unsure)  # the third in a row
    assert sizer.streak == 3 and [sizer.drafts() for _ in range(2)] == [False, True]
    sizer.choose(unsure)  # still AR when it looks again: twice as many
    assert [sizer.drafts() for _ in range(3)] == [False, False, True]
    with pytest.raises(ValueError, match="skip_after"):
        candidate_sizes(BudgetPolicy(skip_after=0), None, torch.device("cpu"))


def test_expected_length_formula():
    tree = bushy(0.5, depth=3, width=2)  # chains a (0.5, 0.25, 0.125) and b (0.5, 0.25, 0.125)
    nodes = best_first(tree.parents.tolist(), tree.logq.tolist())
    assert [round(p, 4) for _, _, p in nodes] == [0.5, 0.5, 0.25, 0.25, 0.125, 0.125]
    assert [d for _, d, _ in nodes] == [1, 1, 2, 2, 3, 3]
    assert reach_sums(nodes[:3]) == pytest.approx([1.0, 1.0, 0.25])
    assert expected_length(reach_sums(nodes), [1.0] * 4) == pytest.approx(1 + 1 + 0.5 + 0.25)
    # factors scale each depth's reach, capped by the depth above
    assert expected_length(reach_sums(nodes), [1.0, 0.5, 4.0, 1.0]) == pytest.approx(1 + 0.5 + 0.5 + 0.25)
    assert expected_lengths(nodes, (0, 1, 6), [1.0] * 4) == pytest.approx([1.0, 1.5, 2.75])
    # (built up node by node for all sizes at once: the same as each prefix on its own, in any order of sizes)
    factors = [1.0, 0.5, 4.0, 1.0]
    sizes = (6, 0, 3, 2, 9, 3)
    assert expected_lengths(nodes, sizes, factors) == [
        expected_length(reach_sums(nodes[:k]), factors) if k else 1.0 for k in sizes]


def test_eager_steps_choose_among_every_size():
    """Eager steps verify any size, so auto chooses among every draft count up to the largest (costs interpolated);
    fixed-shape steps keep to their buckets; ``every_size`` overrides either way."""
    policy = BudgetPolicy()
    assert policy.choices((0, 4, 8), "eager") == tuple(range(9))
    assert policy.choices((0, 4, 8), "graph") == policy.choices((0, 4, 8), "static") == (0, 4, 8)
    assert policy.choices((4, 8), "eager") == (4, 5, 6, 7, 8)  # (no AR measured: nothing below the least size)
    assert BudgetPolicy(every_size=False).choices((0, 4, 8), "eager") == (0, 4, 8)
    assert BudgetPolicy(every_size=True).choices((0, 4), "graph") == (0, 1, 2, 3, 4)
    # a tree worth 5 drafts on a linear cost: chosen at 5, between the measured 4 and 8
    linear = CostTable(((0, 10.0), (4, 14.0), (8, 18.0)), 2.0)
    tree = bushy(0.97, depth=5, width=3)  # a sure chain of 5, side chains worth less than a node's cost
    assert AutoBudget(policy, linear, tuple(range(9)), BLOCK - 1).choose(tree).num_drafts == 5
    assert AutoBudget(policy, linear, (0, 4, 8), BLOCK - 1).choose(tree).num_drafts in (4, 8)


def test_eager_trees_are_built_one_size_past_the_last_choice():
    """With a look-ahead (a resizable, eager proposer's) and ``look_ahead_gap=0`` the next tree is built
    ``look_ahead`` drafts past the size chosen last: the largest at first, raised by a choice at the bound, the
    largest again after steps without drafting; without one (fixed-shape proposers, ``look_ahead=0``, CUDA by
    default) the largest always (``build`` None: the proposer's own budget)."""
    linear = CostTable(((0, 10.0), (4, 14.0), (8, 18.0)), 2.0)
    sure = bushy(0.97, depth=5, width=3)  # chosen at 5 (test above)
    sizer = AutoBudget(BudgetPolicy(look_ahead_gap=0), linear, tuple(range(9)), BLOCK - 1, look_ahead=1)
    assert sizer.build == 8
    assert sizer.choose(sure).num_drafts == 5 and sizer.build == 6
    chain = bushy(0.97, depth=6, width=1)  # every node worth its cost: the whole tree, at the bound
    assert sizer.choose(chain).num_drafts == 6 and sizer.build == 7
    assert sizer.choose(bushy(0.97, depth=7, width=1)).num_drafts == 7 and sizer.build == 8
    assert sizer.choose(chain).num_drafts == 6 and sizer.build == 7
    assert sizer.choose(bushy(0.01, width=1)).num_drafts == 0 and sizer.build == 8 and not sizer.drafts()  # AR
    two = AutoBudget(BudgetPolicy(look_ahead_gap=0), linear, tuple(range(9)), BLOCK - 1, look_ahead=2)
    two.choose(sure)
    assert two.build == 7
    fixed = AutoBudget(BudgetPolicy(), linear, tuple(range(9)), BLOCK - 1)
    fixed.choose(sure)
    assert fixed.build is None
    assert BudgetPolicy().look_ahead_on("cpu") == 1 and BudgetPolicy().look_ahead_on("cuda") == 0
    assert BudgetPolicy(look_ahead=0).look_ahead_on("cpu") == 0 and BudgetPolicy(look_ahead=3).look_ahead_on("cuda") == 3
    with pytest.raises(ValueError, match="look_ahead"):
        candidate_sizes(BudgetPolicy(look_ahead=-1), TINY_TARGETS["llama"](), "cpu")


def test_look_aheads_grow_sparse_while_their_extra_drafts_are_not_chosen():
    """Between look-aheads a tree is built at the size chosen last. A look-ahead not taken doubles the steps to the
    next one, up to ``look_ahead_gap``; one taken, or a choice below the last, brings one the next step; skipped
    steps start over."""
    linear = CostTable(((0, 10.0), (4, 14.0), (8, 18.0)), 2.0)
    sizer = AutoBudget(BudgetPolicy(look_ahead_gap=4), linear, tuple(range(9)), BLOCK - 1, look_ahead=1)

    def step(tree):  # the tree the proposer builds at the sizer's size: its best-first prefix
        keep = [i for i, _, _ in best_first(tree.parents.tolist(), tree.logq.tolist())[:sizer.build]]
        return sizer.choose(subtree(tree, keep)).num_drafts

    sure = bushy(0.97, depth=5, width=3)  # worth 5 drafts from any larger tree
    builds = [sizer.build]
    for _ in range(14):
        assert step(sure) == 5
        builds.append(sizer.build)
    # the largest, one past 5 (5 was more than 0), then look-aheads 1, 2, 4, 4 steps apart
    assert builds == [8, 6, 5, 6, 5, 5, 6, 5, 5, 5, 5, 6, 5, 5, 5], builds
    chain = bushy(0.97, depth=8, width=1)  # every node worth its cost: grows at the next look-ahead, then each step
    chosen = [step(chain) for _ in range(5)]
    assert chosen == [5, 5, 6, 7, 8] and sizer.build == 8, chosen
    assert step(bushy(0.01, width=1)) == 0 and not sizer.drafts() and sizer.build == 8  # AR: skipped, then the largest
    sizer = AutoBudget(BudgetPolicy(look_ahead_gap=4), linear, tuple(range(9)), BLOCK - 1, look_ahead=1)
    assert [step(sure) for _ in range(4)] == [5] * 4 and sizer.build == 5  # (two steps to the next look-ahead)
    assert step(bushy(0.97, depth=3, width=3)) == 3 and sizer.build == 4  # a dip: a look-ahead the next step
    assert step(sure) == 4 and sizer.build == 5 and step(sure) == 5 and sizer.build == 6  # taken: again
    with pytest.raises(ValueError, match="look_ahead_gap"):
        candidate_sizes(BudgetPolicy(look_ahead_gap=-1), TINY_TARGETS["llama"](), "cpu")


def test_a_step_asks_the_eager_proposer_for_the_built_size(monkeypatch):
    """The loop passes the sizer's build size to an eager proposer, which drafts that many depths and builds that
    tree (output unchanged); a budget above the proposer's own, or any other on a fixed-shape one, is refused."""
    from modeling_weaver.decoding.drafting import EagerProposer, Proposer

    target = TINY_TARGETS["llama"]()
    drafter, weaver = make_drafters(target)
    asked, propose = [], EagerProposer.propose

    def recording(self, *args, budget=None):
        proposal = propose(self, *args, budget=budget)
        asked.append((budget, proposal.tree.num_drafts))
        return proposal

    monkeypatch.setattr(EagerProposer, "propose", recording)
    ids, new = prompts(2)[1], 40
    expected = reference(target, ids, new)
    runner = AlternatingOracle(reference(target, ids, new + 2 * BLOCK), text_config(target.config).hidden_size)
    got, _ = _decode(target, ids[0], runner=runner, weaver=None, mode="ddtree", tree_budget="auto",
                     max_new_tokens=new, processors=LogitsProcessorList(), do_sample=False, verification=None,
                     generator=None, streamer=None, budget_policy=BudgetPolicy(costs=STEEP, max_size=32),
                     stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(ids.shape[1] + new)]))
    assert torch.equal(got, expected)
    assert asked[0][0] == 32 and all(0 < b <= 32 and n <= b for b, n in asked), asked
    assert min(b for b, _ in asked) < 32, asked  # (a smaller tree after a smaller choice)
    proposer = EagerProposer(DFlashRunner(drafter, target), "ddtree", 8, None, target)
    with pytest.raises(ValueError, match="budget must be 1..8"):
        proposer.propose(0, torch.zeros(1, 1), 1, torch.zeros(1), budget=9)

    class Fixed(Proposer):
        budget = 4

    assert Fixed()._budget(None) == Fixed()._budget(4) == 4
    with pytest.raises(ValueError, match="budget must be 4"):
        Fixed()._budget(3)


def test_calibration_follows_observed_acceptance():
    sizer = AutoBudget(BudgetPolicy(decay=0.5), FLAT, SIZES, BLOCK - 1)
    for _ in range(6):  # the drafter says 0.9 per depth; only the first draft is ever accepted
        assert sizer.drafts()
        sizer.choose(bushy(0.9))
        sizer.observe(2)
    factors = sizer.factors()
    assert factors[1] > 0.95 and factors[2] < 0.1 and factors[3] < 0.1
    sizer.drafts()
    assert len(sizer.choose(Tree.from_lists([0], [-1]))) == 1  # nothing drafted: an AR step
    sizer.observe(5)  # after an AR step nothing is learned
    assert sizer.factors() == factors


def test_calibration_forgets_in_proportion_to_the_evidence():
    """A step forgets a depth's sums by δ^S_d: after a run of steps at a rarely reached depth (S_d 0.1) whose
    acceptances came early, the factor still remembers them, where forgetting by δ per step (the old rule) would
    have driven it to a tenth; a depth reached at every step (S_d 1) forgets as fast as before."""
    sizer = AutoBudget(BudgetPolicy(decay=0.9), FLAT, SIZES, 7)
    steps = [4] * 2 + [2] * 20  # depths 1 and 2 held with reach 1.0 and 0.1; depth 2 accepted in the first two only
    for accepted in steps:
        sizer.drafts()
        sizer.reach = [1.0, 1.0, 0.1]
        sizer.observe(accepted)
    o2, p2 = sizer.observed[2], sizer.predicted[2]
    rate = 0.9 ** 0.1
    assert o2 == pytest.approx(sum(rate ** k for k in range(20, 22)), rel=1e-12)
    assert p2 == pytest.approx(0.1 * sum(rate ** k for k in range(22)), rel=1e-12)
    assert sizer.factors()[2] > 0.5  # (0.86; forgetting by δ a step, the old rule, gave 0.33)
    assert sizer.observed[1] == pytest.approx(sum(0.9 ** k for k in range(22)), rel=1e-12)


def test_the_host_calibration_is_the_devices():
    """AutoBudget.observe (host floats, eager steps) updates as calibrate (device tensors, fused steps) does, over
    random steps: reach sums of varying depth, acceptances, a prior worn to its floor."""
    import random

    rng = random.Random(0)
    sizer = AutoBudget(BudgetPolicy(decay=0.8), FLAT, SIZES, 7)
    observed, predicted, prior = torch.zeros(3, 8, dtype=torch.float64)
    prior += 1.0
    for _ in range(300):
        depth = rng.randint(0, 9)
        reach = [1.0] + [rng.uniform(0.0, 1.0) * (rng.random() < 0.9) for _ in range(depth)]
        accepted = rng.randint(1, depth + 1)
        sizer.drafts()
        sizer.reach = reach
        sizer.observe(accepted)
        sums = torch.zeros(8, dtype=torch.float64)
        sums[:min(8, len(reach))] = torch.tensor(reach[:8], dtype=torch.float64)
        calibrate(observed, predicted, prior, sums, accepted, 0.8)
        for host, device in ((sizer.observed, observed), (sizer.predicted, predicted), (sizer.prior, prior)):
            assert host == pytest.approx(device.tolist(), rel=1e-12, abs=1e-300)
    assert min(sizer.prior[1:]) == pytest.approx(1e-6)  # (the floor reached)


def test_unheld_depths_are_rated_as_the_depth_above():
    """c_d = (O_d + W_d c_{d-1}) / (P_d + W_d): the closed form equals the recursion, a depth never held takes the
    correction of the deepest one held (a shallow tree never makes deeper ones look as bad as the raw scores), and a
    prior worn down to its floor leaves the factors finite."""
    generator = torch.Generator().manual_seed(0)
    observed, predicted = torch.rand(8, generator=generator, dtype=torch.float64) * 3, torch.rand(8, dtype=torch.float64)
    prior = torch.rand(8, generator=generator, dtype=torch.float64)
    observed[5:] = predicted[5:] = 0.0
    prior[5:] = 1.0
    factors, c = depth_factors(observed, predicted, prior).tolist(), [1.0]
    for d in range(1, 8):
        c.append((observed[d].item() + prior[d].item() * c[-1]) / (predicted[d].item() + prior[d].item()))
    assert factors == pytest.approx(c, rel=1e-12) and factors[5] == factors[6] == factors[7] == pytest.approx(c[4])
    sizer = AutoBudget(BudgetPolicy(), FLAT, SIZES, 7)
    for _ in range(2000):  # a drafter ten times better than its scores, trees held to depth 3 only
        sizer.drafts()
        sizer.reach = [1.0, 0.1, 0.1, 0.1]
        sizer.observe(4)
    factors = sizer.factors()
    assert factors[1:4] == pytest.approx([10.0] * 3, rel=1e-5)
    assert factors[4] == factors[7] == pytest.approx(factors[3])  # (the old prior of 1 rated depth 4 at 1)
    assert sizer.prior[1] == pytest.approx(1e-6) and all(math.isfinite(f) for f in factors)


def random_tree(rng, nodes: int, padding: int) -> Tree:
    parents = [-1] + [rng.randrange(i) for i in range(1, nodes)]
    logq = [0.0] + [math.log(rng.uniform(0.01, 1.0)) for _ in range(1, nodes)]
    return Tree.from_lists(list(range(nodes)), parents, logq).padded(nodes + padding)


def test_the_device_choice_is_the_hosts():
    """choose_on_device (fused auto steps) against AutoBudget.choose on random trees (padding roots included),
    factors and cost tables: the same size, the same steady AR verdict, the same kept nodes and reach sums; the
    chosen sizes vary (AR, every bucket, a prefix limited by the drafts there are)."""
    import random

    sizes, seen = (0, 4, 8, 16, 32), set()
    for seed in range(200):
        rng = random.Random(seed)
        tree = random_tree(rng, rng.randint(1, 40), rng.randint(0, 5))
        costs = CostTable(((0, 10.0), (4, 10 + rng.uniform(0, 8)), (8, 12 + rng.uniform(0, 10)),
                           (16, 20 + rng.uniform(0, 10)), (32, 30 + rng.uniform(0, 30))), rng.uniform(0.5, 20))
        sizer = AutoBudget(BudgetPolicy(), costs, sizes, 15)
        for name in ("observed", "predicted", "prior"):
            setattr(sizer, name, [rng.uniform(0.01, 5) for _ in range(16)])
        factors = depth_factors(*(torch.tensor(getattr(sizer, name), dtype=torch.float64)
                                  for name in ("observed", "predicted", "prior")))
        assert sizer.factors() == pytest.approx(factors.tolist(), rel=1e-12)  # (the host's recurrence)
        choice, rank, sums = choose_on_device(tree.parents, tree.logq, factors, torch.tensor(sizes),
                                              torch.tensor([costs.verify(k) for k in range(33)], dtype=torch.float64),
                                              costs.propose_ms)
        bucket, ar, drafts = choice.tolist()
        nodes = best_first(tree.parents.tolist(), tree.logq.tolist())
        cut = sizer.choose(tree)
        assert drafts == cut.num_drafts and bool(ar) == (sizer.streak == 1), seed  # (a fresh sizer: its 1st verdict)
        assert sizes[bucket] == min(s for s in sizes if s >= drafts)
        assert sorted((rank[1:] < drafts).nonzero()[:, 0].add(1).tolist()) == sorted(i for i, _, _ in nodes[:drafts])
        held = (sizer.reach or [0.0])[1:]  # (index 0: the root, which calibrates nothing)
        assert sums.tolist()[1:len(held) + 1] == pytest.approx(held, rel=1e-12) and sums[len(held) + 1:].sum() == 0
        assert int(rank[0]) == -1 and sums[1:].sum() > 0 or drafts == 0
        seen.add(drafts)
    assert {0, 4, 8, 16} <= seen and seen - set(sizes), seen


def test_a_best_first_cut_is_the_subtree_with_its_own_ancestor_mask():
    """prefix_cut (fused auto steps): the kept prefix in the tree's order, padding roots after it, and a mask taken
    from the whole tree's equal to the cut tree's own ancestor mask."""
    import random

    from modeling_weaver.decoding.adaptive import prefix_cut
    from modeling_weaver.tree import ancestor_mask_of

    for seed in range(60):
        rng = random.Random(seed)
        tree = random_tree(rng, rng.randint(1, 30), rng.randint(0, 4))
        n = len(tree)
        costs = CostTable(((0, 10.0), (32, 10.0 + rng.uniform(0, 20))), rng.uniform(0, 5))
        _, rank, _ = choose_on_device(tree.parents, tree.logq, torch.ones(16, dtype=torch.float64),
                                      torch.tensor([0, 32]), torch.tensor([costs.verify(k) for k in range(33)],
                                                                          dtype=torch.float64), costs.propose_ms)
        drafts = rng.randint(0, int((tree.parents >= 0).sum()))  # (padding roots rank after every draft)
        keep = rank < drafts
        nodes = min(n, drafts + 1 + rng.randint(0, 3))  # (a bucket never exceeds the drafted tree)
        tokens, parents, logq, mask = prefix_cut(keep, tree.tokens, tree.parents, tree.logq,
                                                 ancestor_mask_of(tree.parents), nodes)
        kept = keep.nonzero()[:, 0].tolist()
        assert tokens[:len(kept)].tolist() == tree.tokens[kept].tolist() and tokens[len(kept):].eq(0).all()
        assert parents[len(kept):].eq(-1).all() and logq[len(kept):].eq(float("-inf")).all()
        assert torch.equal(mask, ancestor_mask_of(parents)), seed
        number = {old: new for new, old in enumerate(kept)}
        assert parents[1:len(kept)].tolist() == [number[int(tree.parents[i])] for i in kept[1:]]


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_fused_auto_steps(name, monkeypatch):
    """Greedy fixed-shape steps with auto run as FusedAutoSteps (the size chosen on the device): token-identical to
    target.generate, on a flat table (trees) and a steep one (AR steps without drafting, then a draft again that
    reads their rows: the drafter's context covers every position)."""
    target = TINY_TARGETS[name]()
    drafter, weaver = make_drafters(target)
    new, ids = 40, prompts(2)[1]
    expected = reference(target, ids, new)
    drafted, loads = [], []  # committed length at each draft; (first, end) positions of each context loaded
    choose, load = FusedAutoSteps._choose, StaticDraft.load
    monkeypatch.setattr(FusedAutoSteps, "_choose",
                        lambda self: drafted.append(self.target.adapter.length) or choose(self))
    monkeypatch.setattr(StaticDraft, "load", lambda self, bonus, context, n: loads.append(
        (n - context.shape[0], n, len(drafted))) or load(self, bonus, context, n))
    for costs, mode in ((FLAT, "weaver"), (STEEP, "ddtree"), (STEEP, "weaver")):
        drafted.clear()
        loads.clear()
        got, stats = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget="auto",
                                          max_new_tokens=new, target_step="static", return_stats=True,
                                          budget_policy=BudgetPolicy(costs=costs, max_size=32))
        assert torch.equal(got, expected), (costs, mode)
        histogram = stats.size_histogram
        assert sum(histogram.values()) == stats.num_steps and stats.calibration["sizes"] == list(SIZES)
        assert max(histogram) >= (4 if costs is FLAT else 0), histogram
        if costs is STEEP:  # AR steps that did not draft, and drafts after them
            assert 1 < len(drafted) < stats.num_steps and len(loads) > 1, (len(drafted), stats.num_steps)
        # the prompt, then after AR steps every position since the last draft committed its first token
        assert loads[0][:2] == (0, ids.shape[1]) and all(first == drafted[k - 1] for first, _, k in loads[1:])


def test_compiled_fused_auto_steps(monkeypatch):
    """The choice, cut and calibration update compiled (as on CUDA graphs): the same choices as eager on random trees,
    and token identity with target.generate through AR steps and trees."""
    import functools
    import random

    from modeling_weaver.decoding import adaptive

    compiled = adaptive.compile_static(adaptive.decide)
    for seed in range(8):
        rng = random.Random(seed)
        tree = random_tree(rng, 64, 0)
        calibration = [torch.tensor([rng.uniform(0.01, 5) for _ in range(16)], dtype=torch.float64) for _ in range(3)]
        args = (tree.parents, tree.logq, *calibration, torch.tensor(SIZES),
                torch.tensor([STEEP.verify(k) for k in range(65)], dtype=torch.float64),
                torch.tensor(STEEP.propose_ms, dtype=torch.float64))
        for got, want in zip(compiled(*args), adaptive.decide(*args)):
            assert torch.allclose(got, want, rtol=1e-12, atol=0) if got.is_floating_point() else torch.equal(got, want)
    monkeypatch.setattr(adaptive, "FusedAutoSteps", functools.partial(adaptive.FusedAutoSteps, compile=True))
    target = TINY_TARGETS["llama"]()
    drafter, weaver = make_drafters(target)
    ids = prompts(2)[1]
    expected = reference(target, ids, 24)
    for costs in (FLAT, STEEP):
        got, stats = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode="ddtree",
                                          tree_budget="auto", max_new_tokens=24, target_step="static",
                                          return_stats=True, budget_policy=BudgetPolicy(costs=costs, max_size=32))
        assert torch.equal(got, expected), costs
        assert max(stats.size_histogram) > 0 if costs is FLAT else 0 in stats.size_histogram, stats.size_histogram


@pytest.mark.parametrize("kind", ["ddtree", "spine", "best_first"])
def test_best_first_prefixes_are_subtrees(kind):
    """Every prefix of the best-first order holds its nodes' ancestors, whatever order the builder left the nodes in
    (best-first Weaver rounds are in round order); the cut keeps tokens, logq and the parent links."""
    torch.manual_seed(0)
    logits = torch.randn(BLOCK - 1, VOCAB) * 3
    if kind == "ddtree":
        tree = ddtree(5, logits, 32)
    else:
        target = TINY_TARGETS["llama"]()
        drafter, weaver = make_drafters(target)
        hidden = torch.randn(BLOCK - 1, target.config.hidden_size)
        prompt = weaver.encode_prompt(torch.randn(1, target.config.hidden_size), hidden[None])
        tree = weaver_tree(5, weaver, prompt, logits, target.get_input_embeddings(), target.lm_head.weight, 32,
                           policy=TreePolicy(spine=kind == "spine"))
    parents = tree.parents.tolist()
    nodes = best_first(parents, tree.logq.tolist())
    assert len(nodes) == sum(p >= 0 for p in parents)
    for k in range(len(nodes) + 1):
        kept = {i for i, _, _ in nodes[:k]}
        assert all(parents[i] == 0 or parents[i] in kept for i in kept)
        cut = subtree(tree, sorted(kept))
        assert len(cut) == k + 1 and cut.tokens[0] == tree.tokens[0]
        for new, old in enumerate([0] + sorted(kept)):  # same paths: each kept node's ancestor tokens are its own
            assert [int(cut.tokens[j]) for j in cut.path_to(new)] == [int(tree.tokens[j]) for j in tree.path_to(old)]
            assert cut.logq[new].item() == tree.logq[old].item()


class AlternatingOracle(OracleRunner):
    """An oracle that is sure on two drafts in three and knows nothing on the third; it checks that the context it
    is given covers every position since its last draft (the AR steps in between included)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls, self.last = 0, 0

    def draft(self, bonus, context, n, depths=None):
        assert context.shape[0] == n - self.last, (context.shape, n, self.last)
        self.calls, self.last = self.calls + 1, n
        hidden, logits = super().draft(bonus, context, n, depths)
        return hidden, logits if self.calls % 3 else torch.zeros_like(logits)


@pytest.mark.parametrize("mode", ["weaver", "ddtree"])
@pytest.mark.parametrize("name", list(TINY_TARGETS))
def test_greedy_identity_with_auto(name, mode):
    """Token-identical to target.generate(do_sample=False) in fp32: the real random drafters (AR steps mostly, with
    probes), and an oracle that makes the policy switch between trees of several sizes and AR steps."""
    target = TINY_TARGETS[name]()
    drafter, weaver = make_drafters(target)
    with torch.no_grad():  # Weaver adds nothing to the planted marginals: its trees follow them
        oracle_weaver = WeaverModel(weaver.config).eval()
        oracle_weaver.load_state_dict(weaver.state_dict())
        oracle_weaver.lm_head_query_in.weight.zero_()
    new = 40
    for seed, ids in enumerate(prompts(2)[1:]):
        expected = reference(target, ids, new)
        got, stats = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget="auto",
                                          max_new_tokens=new, return_stats=True,
                                          budget_policy=BudgetPolicy(costs=MIXED, max_size=32))
        assert torch.equal(got, expected), (name, mode, seed)
        # (eager steps choose among every draft count up to the largest, costs interpolated)
        assert stats.calibration["costs"]["source"] == "given" and stats.calibration["sizes"] == list(range(33))
        runner = AlternatingOracle(reference(target, ids, new + 2 * BLOCK), text_config(target.config).hidden_size,
                                   seed=seed)
        got, stats = _decode(target, ids[0], runner=runner, weaver=oracle_weaver, mode=mode, tree_budget="auto",
                             max_new_tokens=new, processors=LogitsProcessorList(), do_sample=False,
                             verification=None, generator=None, streamer=None,
                             budget_policy=BudgetPolicy(costs=STEEP, max_size=32),
                             stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(ids.shape[1] + new)]))
        assert torch.equal(got, expected), (name, mode, seed, "oracle")
        histogram = stats.size_histogram
        assert histogram.get(0, 0) > 0 and max(histogram) >= 4, histogram  # AR steps and real trees both
        assert sum(histogram.values()) == stats.num_steps and 1 in stats.tree_sizes


def test_custom_generate_with_auto():
    target = TINY_TARGETS["qwen3"]()
    drafter, weaver = make_drafters(target)
    ids = prompts(2)[1]
    got = target.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=generate, drafter=drafter,
                          weaver=weaver, tree_budget="auto", budget_policy=BudgetPolicy(costs=MIXED, max_size=32),
                          max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert torch.equal(got, reference(target, ids, 24))


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_greedy_identity_with_auto_in_fixed_shape_steps(name):
    """target_step="static" (the code of CUDA-graph steps, uncaptured): each step verifies in the bucket of its size
    and commits through it; token-identical to target.generate, with AR steps and trees of several sizes."""
    target = TINY_TARGETS[name]()
    drafter, weaver = make_drafters(target)
    with torch.no_grad():
        oracle_weaver = WeaverModel(weaver.config).eval()
        oracle_weaver.load_state_dict(weaver.state_dict())
        oracle_weaver.lm_head_query_in.weight.zero_()
    new, ids = 40, prompts(2)[1]
    expected = reference(target, ids, new)
    got = speculative_generate(target, ids, drafter=drafter, weaver=weaver, tree_budget="auto", max_new_tokens=new,
                               target_step="static", budget_policy=BudgetPolicy(costs=MIXED, max_size=32))
    assert torch.equal(got, expected)
    runner = AlternatingOracle(reference(target, ids, new + 2 * BLOCK), text_config(target.config).hidden_size, seed=1)
    got, stats = _decode(target, ids[0], runner=runner, weaver=oracle_weaver, mode="weaver", tree_budget="auto",
                         max_new_tokens=new, processors=LogitsProcessorList(), do_sample=False, verification=None,
                         generator=None, streamer=None, budget_policy=BudgetPolicy(costs=STEEP, max_size=32),
                         target_step="static",
                         stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(ids.shape[1] + new)]))
    assert torch.equal(got, expected), "oracle"
    histogram = stats.size_histogram
    assert histogram.get(0, 0) > 0 and max(histogram) >= 4, histogram
    buckets = next(v for k, v in step_cache._STATIC_TARGETS[target].items() if k[0] == "buckets")
    assert isinstance(buckets, BucketedTarget) and len(buckets.steps) >= 2  # (made on first use: the sizes run)
    assert set(buckets.steps) <= {s + 1 for s in SIZES}


def test_bucketed_target_verifies_like_the_adapter():
    """Trees of several sizes through one BucketedTarget: logits as the eager adapter's on every node, each commit
    through the step that verified, the committed length shared; misuse refused."""
    target = TINY_TARGETS["qwen3_5"]()
    ids = prompts(1)[0][0]
    eager = TargetAdapter(target, max_length=256)
    buckets = BucketedTarget(TargetAdapter(target, max_length=256), [1, 5, 9], capture=False)
    eager.prefill(ids)
    buckets.prefill(ids)
    generator = torch.Generator().manual_seed(0)
    for size, path in ((3, [0, 1]), (1, [0]), (9, [0, 2, 5]), (5, [0, 1, 3])):
        parents = [-1] + [int(torch.randint(0, i, (), generator=generator)) for i in range(1, size)]
        tree = Tree.from_lists(torch.randint(0, VOCAB, (size,), generator=generator).tolist(), parents)
        want, got = eager.verify(tree).logits, buckets.verify(tree).logits
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5), size
        assert buckets._verified is buckets.steps[next(s for s in (1, 5, 9) if s >= size)]
        path = [p for p in path if p < size]
        eager.commit(path)
        buckets.commit(path)
        assert buckets.length == eager.length
    with pytest.raises(ValueError, match="does not fit"):
        buckets.verify(Tree.from_lists([1] * 10, [-1] + list(range(9))))
    with pytest.raises(RuntimeError, match="follow verify"):
        buckets.commit([0])
    with pytest.raises(ValueError, match="root included"):
        BucketedTarget(eager, [0, 4])


def test_auto_is_checked():
    target = TINY_TARGETS["llama"]()
    drafter, weaver = make_drafters(target)
    ids = prompts(1)[0]
    with pytest.raises(ValueError, match="budget_policy"):
        speculative_generate(target, ids, drafter=drafter, weaver=weaver, tree_budget=8, budget_policy=BudgetPolicy())
    with pytest.raises(TypeError, match="tree_budget"):
        speculative_generate(target, ids, drafter=drafter, weaver=weaver, tree_budget="big")
    with pytest.raises(ValueError, match="sizes"):
        speculative_generate(target, ids, drafter=drafter, weaver=weaver, tree_budget="auto",
                             budget_policy=BudgetPolicy(sizes=(-1, 4)))


def test_sampling_with_auto_is_exact_in_distribution():
    """The first three sampled tokens (a prefill token, then steps whose sizes the policy picks from what was sampled
    before) follow the processed target distribution; negative control: the same counts reject the distribution
    at another temperature."""
    from scipy.stats import chisquare

    vocab, temperature, draws = 4, 0.8, 600
    target, drafter = toy_vocab_pair(vocab)
    prompt = torch.tensor([[1, 3, 2]])

    def distribution(temp):
        return three_token_distribution(target, prompt, lambda logits: (logits / temp).softmax(-1))

    # costs where a tree pays only when the drafter is sure (and the calibration agrees): AR and tree steps both
    costs = CostTable(((0, 10.0), (1, 13.0), (2, 15.0), (3, 17.0)), 4.0)
    gen = torch.Generator().manual_seed(7)
    counts = torch.zeros(vocab ** 3, dtype=torch.float64)
    sizes: dict[int, int] = {}
    for i in range(draws):  # (DDTree trees: cheaper to build than Weaver's, and auto treats both alike)
        verification = ("target_only", "traversal")[i % 2]
        out, stats = speculative_generate(target, prompt, drafter=drafter, mode="ddtree", verification=verification,
                                          tree_budget="auto", max_new_tokens=3, do_sample=True,
                                          temperature=temperature, generator=gen, return_stats=True,
                                          budget_policy=BudgetPolicy(sizes=(0, 1, 2, 3), costs=costs))
        x1, x2, x3 = out[0, -3:].tolist()
        counts[(x1 * vocab + x2) * vocab + x3] += 1
        for size, n in stats.size_histogram.items():
            sizes[size] = sizes.get(size, 0) + n
    assert sizes.get(0, 0) > 0 and sum(n for s, n in sizes.items() if s > 0) > 0, sizes  # both kinds of step

    def pvalue(expected):
        exp = expected * draws
        big = exp >= 5
        obs = torch.cat([counts[big], counts[~big].sum()[None]])
        exp = torch.cat([exp[big], exp[~big].sum()[None]])
        return chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue

    assert pvalue(distribution(temperature)) > 0.01
    assert pvalue(distribution(1.6)) < 1e-6  # the test sees a wrong distribution


def _tiny_llama_setup():
    target = TINY_TARGETS["llama"]()
    drafter, weaver = make_drafters(target)
    return target, drafter, weaver


def test_eager_steps_measure_every_small_size():
    """A few rows' verify cost steps with its GEMMs' row blocking, so eager steps measure every count up to
    ``dense_costs`` and interpolate only above it; fixed-shape steps measure their buckets."""
    policy = BudgetPolicy()
    assert policy.measured((0, 4, 8), "eager") == tuple(range(9))
    assert policy.measured((0, 4, 8, 16, 32, 64), "eager") == (*range(17), 32, 64)
    assert policy.measured((0, 4, 8), "graph") == policy.measured((0, 4, 8), "static") == (0, 4, 8)
    assert BudgetPolicy(every_size=True).measured((0, 4), "graph") == (0, 4)  # (a bucket's cost is what it runs)
    assert BudgetPolicy(dense_costs=4).measured((0, 4, 8), "eager") == (0, 1, 2, 3, 4, 8)
    assert BudgetPolicy(every_size=False).measured((0, 4, 8), "eager") == (0, 4, 8)
    assert BudgetPolicy().measured((4, 8), "eager") == (4, 5, 6, 7, 8)
    target, drafter, weaver = _tiny_llama_setup()
    with pytest.raises(ValueError, match="dense_costs"):
        speculative_generate(target, prompts(1)[0], drafter=drafter, weaver=weaver, tree_budget="auto",
                             budget_policy=BudgetPolicy(dense_costs=-1))


QUICK = dict(calibration_reps=1, calibration_context=8, sizes=(0, 4, 8))


def test_warm_sizes_verifies_every_eager_size_once_and_caches_nothing(tmp_path, monkeypatch):
    """warm_sizes (the demo's warm-up for auto): one round of the calibration's steps at every size an eager auto
    generation may verify, with the generation's own parts, and no cost table written."""
    from modeling_weaver.decoding import budget as budget_module

    monkeypatch.setenv("MODELING_WEAVER_CACHE", str(tmp_path))
    target, drafter, weaver = _tiny_llama_setup()
    seen = []
    measure = budget_module.measure_costs

    def recording(target_, runner, weaver_, mode, sizes, tree_policy, step_options, policy, step="eager"):
        seen.append((mode, sizes, policy.calibration_reps, step))
        return measure(target_, runner, weaver_, mode, sizes, tree_policy, step_options, policy, step)

    monkeypatch.setattr(budget_module, "measure_costs", recording)
    policy = BudgetPolicy(**{**QUICK, "calibration_reps": 3})
    budget_module.warm_sizes(target, drafter, weaver, "weaver", policy)
    assert seen == [("weaver", tuple(range(9)), 1, "eager")]  # (one timed round, whatever the policy's)
    budget_module.warm_sizes(target, drafter, weaver, None, policy)  # (no mode: the generation's default)
    assert seen[1][0] == default_tree_mode(next(target.parameters()).device, weaver)
    assert not list(tmp_path.iterdir())


def test_calibration_cache_is_keyed_and_read_back(tmp_path, monkeypatch):
    target, drafter, weaver = _tiny_llama_setup()
    ids = prompts(2)[1]
    expected = reference(target, ids, 16)

    def run(policy, mode="weaver", model=target):
        got, stats = speculative_generate(model, ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget="auto",
                                          max_new_tokens=16, return_stats=True, budget_policy=policy)
        return got, stats.calibration["costs"]

    got, measured = run(BudgetPolicy(cache_dir=str(tmp_path), **QUICK))
    assert torch.equal(got, expected) and measured["source"] == "measured"
    entries = json.loads((tmp_path / CACHE_FILE).read_text())
    assert len(entries) == 1
    fields = next(iter(entries.values()))["fields"]
    assert fields["step"] == "eager" and fields["target"] == "LlamaForCausalLM" and fields["dtype"] == "torch.float32"
    assert fields["mode"] == "weaver" and fields["device"].startswith("cpu: ")
    assert fields["sizes"] == list(range(9))  # (eager steps: every count measured)
    assert set(measured["verify_ms"]) == {str(k) for k in range(9)} and measured["propose_ms"] > 0

    def refuse(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(budget_module, "measure_costs", refuse)
    got, cached = run(BudgetPolicy(cache_dir=str(tmp_path), **QUICK))  # a new policy instance reads the file
    assert torch.equal(got, expected) and cached["source"] == "cache"
    assert cached["verify_ms"] == measured["verify_ms"] and cached["fields"] == measured["fields"]
    monkeypatch.undo()

    # another mode, another target config, other module types: other keys, the first entry kept
    _, other = run(BudgetPolicy(cache_dir=str(tmp_path), **QUICK), mode="ddtree")
    assert other["source"] == "measured"
    other_config = TINY_TARGETS["llama"]()
    other_config.config.rms_norm_eps *= 2
    _, third = run(BudgetPolicy(cache_dir=str(tmp_path), **QUICK), model=other_config)
    assert third["source"] == "measured" and third["fields"]["target_signature"] != fields["target_signature"]
    assert len(json.loads((tmp_path / CACHE_FILE).read_text())) == 3
    # recalibrate measures again and replaces its own entry only
    _, again = run(BudgetPolicy(cache_dir=str(tmp_path), recalibrate=True, **QUICK))
    assert again["source"] == "measured" and len(json.loads((tmp_path / CACHE_FILE).read_text())) == 3
    # fixed-shape steps are timed through their own steps, under a key of their own
    got, stats = speculative_generate(target, ids, drafter=drafter, weaver=weaver, tree_budget="auto",
                                      max_new_tokens=16, return_stats=True, target_step="static",
                                      budget_policy=BudgetPolicy(cache_dir=str(tmp_path), **QUICK))
    static = stats.calibration["costs"]
    assert torch.equal(got, expected) and static["source"] == "measured" and static["fields"]["step"] == "static"
    assert len(json.loads((tmp_path / CACHE_FILE).read_text())) == 4


def test_calibration_cache_survives_a_restart(tmp_path):
    """A new process (same setup) reads the table this one measured, without measuring."""
    target, drafter, weaver = _tiny_llama_setup()
    policy = BudgetPolicy(cache_dir=str(tmp_path), **QUICK)
    runner = DFlashRunner(drafter, target)
    table = step_costs(target, runner, weaver, "weaver", policy.sizes, TreePolicy(), StepOptions(), policy)
    assert table.source == "measured"
    script = f"""
import sys
sys.path[:0] = {[str(Path(__file__).parent)]!r}
from tiny_targets import TINY_TARGETS
from test_generate import make_drafters
from modeling_weaver import BudgetPolicy
from modeling_weaver.decoding import budget
from modeling_weaver.decoding.drafting import DFlashRunner, StaticDraft
from modeling_weaver.options import StepOptions, TreePolicy
import torch
torch.set_num_threads(1)
def refuse(*args, **kwargs):
    raise SystemExit("measured again")
budget.measure_costs = refuse
target = TINY_TARGETS["llama"]()
drafter, weaver = make_drafters(target)
policy = BudgetPolicy(cache_dir={str(tmp_path)!r}, **{QUICK!r})
table = budget.step_costs(target, DFlashRunner(drafter, target), weaver, "weaver", policy.sizes, TreePolicy(),
                          StepOptions(), policy)
print(table.source, table.verify_ms, table.propose_ms)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    cached = CostTable.from_dict(table.as_dict(), "cache")  # (as stored: rounded to 0.1 µs)
    assert done.stdout.strip() == f"cache {cached.verify_ms} {cached.propose_ms}"


def test_costs_the_rounds_cannot_tell_apart_are_the_larger_sizes():
    """resolved_costs: medians, lowered to the least at any larger size; a size within the rounds' noise of the next
    costs the next one's (a smaller tree is not bought with a difference the rounds cannot resolve); a clear step
    stays; without noise every distinct median stays (the negative control)."""
    noisy = [[36.0, 35.5, 36.6, 35.7, 36.2], [36.3, 35.9, 36.8, 36.0, 36.5], [40.6, 40.2, 41.1, 40.4, 40.9]]
    assert resolved_costs((4, 5, 6), noisy) == ((4, 36.3), (5, 36.3), (6, 40.6))
    exact = [[36.0] * 5, [36.3] * 5, [40.6] * 5]
    assert resolved_costs((4, 5, 6), exact) == ((4, 36.0), (5, 36.3), (6, 40.6))
    cheaper_above = [[37.0] * 5, [36.3] * 5]  # (a larger size measured cheaper: noise on the smaller)
    assert resolved_costs((4, 5), cheaper_above) == ((4, 36.3), (5, 36.3))


def test_cost_table_interpolates():
    assert MIXED.verify(6) == pytest.approx(11.5) and MIXED.verify(64) == 18.0
    assert MIXED.step_ms(0) == 10.0 and MIXED.step_ms(4) == 13.0
    assert CostTable.from_dict(MIXED.as_dict(), "cache").verify_ms == MIXED.verify_ms


def test_cli_takes_auto(tmp_path):
    from modeling_weaver.cli import build_parser

    args = build_parser().parse_args(["demo", "--tree-budget", "auto", "--recalibrate"])
    assert args.tree_budget == "auto" and args.recalibrate
    assert build_parser().parse_args(["demo", "--tree-budget", "12"]).tree_budget == 12
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--tree-budget", "0"])
    args = build_parser("bench").parse_args(["bench", "--budgets", "16", "auto", "--no-plot", "--target-step", "static",
                                      "--drafter", str(tmp_path), "--modes", "ddtree"])
    assert args.budgets == [16, "auto"] and args.target_step == "static"
    from modeling_weaver.lab.benchmark import build_methods

    assert [m.label for m in build_methods(["ddtree"], [8, "auto"], [0.0])] == ["ar", "ddtree@8", "ddtree@auto"]

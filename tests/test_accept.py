"""Acceptance rules (docs/DESIGN.md §6): greedy exactness, lossless in distribution (χ²), power of the χ² test, and
structural properties on random trees. CPU only."""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

import modeling_weaver.accept as accept_mod
from modeling_weaver.accept import (
    Acceptance,
    accept_greedy,
    accept_greedy_tensors,
    accept_target_only,
    accept_traversal,
)
from modeling_weaver.tree import Tree

V = 6
DRAWS = 20_000
P_PASS = 0.01
P_FAIL = 1e-6

# ---------------------------------------------------------------------------------------------------------------------
# toy autoregressive target, trees and the statistical helper


def toy_target(seed: int, depth: int = 4, zeros: int = 1) -> list[torch.Tensor]:
    """``tables[d][x1..xd]`` = p(x_{d+1} | x1..xd) over V tokens; skewed rows with ``zeros`` zero entries (top-k)."""
    g = torch.Generator().manual_seed(seed)
    tables = []
    for d in range(depth):
        w = (-torch.rand((V,) * (d + 1), generator=g, dtype=torch.float64).log()) ** 2
        if zeros:
            drop = torch.rand(w.shape, generator=g).argsort(-1)[..., :zeros]
            w.scatter_(-1, drop, 0.0)
        tables.append(w / w.sum(-1, keepdim=True))
    return tables


def toy_tree(fanout, seed: int, neg_inf: bool = False) -> Tree:
    """Tree with random distinct sibling tokens and random *unnormalised* logq.

    ``fanout`` is a list (children per node at each depth) or ``"irregular"`` (0-3 children per node, depth <= 3).
    With ``neg_inf`` one child gets ``logq = -inf`` (outside q's support).
    """
    rng = random.Random(seed)
    tokens, parents, logq, depth = [0], [-1], [0.0], [0]
    i = 0
    while i < len(tokens):
        d = depth[i]
        if fanout == "irregular":
            k = rng.randint(2, 3) if d == 0 else (rng.randint(0, 3) if d < 3 else 0)
        else:
            k = fanout[d] if d < len(fanout) else 0
        offset = rng.uniform(-3, 3)  # per sibling group: logq need not be normalised
        for tok in rng.sample(range(V), k):
            tokens.append(tok)
            parents.append(i)
            logq.append(rng.gauss(0.0, 1.5) + offset)
            depth.append(d + 1)
        i += 1
    if neg_inf:
        logq[len(tokens) - 1] = -math.inf
    return Tree.from_lists(tokens, parents, logq)


def node_probs(tree: Tree, tables) -> torch.Tensor:
    """``[N, V]`` target row at every node: p(· | tokens on the path below the root)."""
    rows = []
    for i in range(len(tree)):
        prefix = tree.tokens[tree.path_to(i)[1:]].tolist()
        rows.append(tables[len(prefix)][tuple(prefix)])
    return torch.stack(rows).float()


def emitted_counts(rule, tree: Tree, tables, k: int = 2, draws: int = DRAWS, seed: int = 0) -> Counter:
    """Counts of the first ``k`` tokens emitted after the root over ``draws`` speculative steps on a fixed tree.

    Emitted = accepted path tokens (root excluded), then the bonus, then plain target sampling if still short.
    """
    probs = node_probs(tree, tables)
    tokens = tree.tokens.tolist()
    gen = torch.Generator().manual_seed(seed)
    tail = random.Random(seed + 1)
    cdfs: dict[tuple, list[float]] = {}
    counts: Counter = Counter()
    for _ in range(draws):
        acc = rule(tree, probs, gen)
        seq = [tokens[j] for j in acc.path[1:]] + [acc.bonus]
        while len(seq) < k:
            key = tuple(seq)
            if key not in cdfs:
                cdfs[key] = list(itertools.accumulate(tables[len(seq)][key].tolist()))
            cdf = cdfs[key]
            seq.append(min(bisect.bisect_right(cdf, tail.random() * cdf[-1]), V - 1))
        counts[tuple(seq[:k])] += 1
    return counts


def target_pvalue(counts: Counter, tables, k: int = 2) -> float:
    """χ² p-value of ``counts`` against the target's p(x1..xk); cells of expected count < 5 are merged.

    A sequence of target probability 0 must never be emitted (asserted).
    """
    draws = sum(counts.values())
    obs, exp, small_o, small_e = [], [], 0, 0.0
    for seq in itertools.product(range(V), repeat=k):
        prob = math.prod(float(tables[d][seq[:d] + (seq[d],)]) for d in range(k))
        if prob == 0.0:
            assert counts[seq] == 0, f"emitted impossible sequence {seq}"
            continue
        if prob * draws < 5:
            small_o, small_e = small_o + counts[seq], small_e + prob * draws
        else:
            obs.append(counts[seq])
            exp.append(prob * draws)
    if small_e > 0:
        obs.append(small_o)
        exp.append(small_e)
    scale = sum(obs) / sum(exp)
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


# ---------------------------------------------------------------------------------------------------------------------
# greedy


def _planted_logits(tree: Tree, argmax: list[int]) -> torch.Tensor:
    logits = torch.randn(len(tree), V, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(tree)), torch.tensor(argmax)] = 10.0
    return logits


def test_greedy_follows_planted_path():
    # root(0) -> 1:[3] -> 3:[2] -> 5:[4];  side branches 2:[1], 4:[5]
    tree = Tree.from_lists([0, 3, 1, 2, 5, 4], [-1, 0, 0, 1, 1, 3])
    acc = accept_greedy(tree, _planted_logits(tree, [3, 2, 0, 4, 0, 1]))
    assert acc == Acceptance([0, 1, 3, 5], 1)


def test_greedy_root_argmax_not_a_child():
    tree = Tree.from_lists([0, 3, 1, 2], [-1, 0, 0, 1])
    acc = accept_greedy(tree, _planted_logits(tree, [5, 2, 0, 0]))
    assert acc == Acceptance([0], 5)


def test_greedy_accepts_later_sibling():
    # root children 1:[1], 2:[2], 3:[4]; node 3 has children 4:[0], 5:[5]
    tree = Tree.from_lists([0, 1, 2, 4, 0, 5], [-1, 0, 0, 0, 3, 3])
    acc = accept_greedy(tree, _planted_logits(tree, [4, 0, 0, 5, 0, 3]))
    assert acc == Acceptance([0, 3, 5], 3)
    # root only
    assert accept_greedy(Tree.from_lists([2], [-1]), _planted_logits(Tree.from_lists([2], [-1]), [4])) == Acceptance(
        [0], 4
    )


# ---------------------------------------------------------------------------------------------------------------------
# losslessness in distribution

SHAPES = {
    "chain3": ([1, 1, 1], {}),
    "branch3x2": ([3, 2], {}),
    "branch2x2x2": ([2, 2, 2], {}),
    "star": ([V], {}),
    "irregular": ("irregular", {"neg_inf": True}),
}
TARGET_ONLY_SHAPES = {**SHAPES, "partial2x1": ([2, 1], {})}


@pytest.mark.parametrize("shape", sorted(TARGET_ONLY_SHAPES))
def test_target_only_is_lossless(shape):
    fanout, kw = TARGET_ONLY_SHAPES[shape]
    tables = toy_target(seed=1)
    tree = toy_tree(fanout, seed=11, **kw)
    p = target_pvalue(emitted_counts(accept_target_only, tree, tables), tables)
    assert p > P_PASS, (shape, p)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_traversal_is_lossless(shape):
    fanout, kw = SHAPES[shape]
    tables = toy_target(seed=2)
    tree = toy_tree(fanout, seed=22, **kw)
    p = target_pvalue(emitted_counts(accept_traversal, tree, tables), tables)
    assert p > P_PASS, (shape, p)


def test_traversal_is_lossless_three_tokens():
    """Depth-3 decisions checked directly on (x1, x2, x3)."""
    tables = toy_target(seed=3)
    tree = toy_tree([2, 2, 2], seed=33)
    p = target_pvalue(emitted_counts(accept_traversal, tree, tables, k=3), tables, k=3)
    assert p > P_PASS, p


def test_root_only_tree_samples_target():
    tables = toy_target(seed=4)
    tree = Tree.from_lists([0], [-1])
    for rule in (accept_target_only, accept_traversal):
        counts = emitted_counts(rule, tree, tables, k=1, draws=5000)
        assert target_pvalue(counts, tables, k=1) > P_PASS


# ---------------------------------------------------------------------------------------------------------------------
# negative controls: the same χ² test must reject biased rules


def _biased_target_only(tree, probs, generator):
    """Target-only, but the first child of the root is accepted outright 10% of the time."""
    if float(torch.rand(1, generator=generator)) < 0.1:
        row = probs[1].double()
        return Acceptance([0, 1], int(torch.multinomial(row, 1, generator=generator)))
    return accept_target_only(tree, probs, generator)


def test_negative_control_biased_target_only_fails():
    tables = toy_target(seed=1)
    tree = toy_tree([3, 2], seed=11)
    p = target_pvalue(emitted_counts(_biased_target_only, tree, tables), tables)
    assert p < P_FAIL, p


@pytest.mark.parametrize(
    "wrong_alpha",
    [
        pytest.param(lambda m, a: a, id="alpha-not-updated"),
        pytest.param(lambda m, a: min(1.0, m), id="alpha-is-residual-mass"),
        pytest.param(lambda m, a: 1.0, id="alpha-reset-to-one"),
    ],
)
def test_negative_control_wrong_traversal_update_fails(monkeypatch, wrong_alpha):
    """Plausible mistakes in the α update after a rejection (the rest of the algorithm unchanged)."""
    monkeypatch.setattr(accept_mod, "_residual_alpha", wrong_alpha)
    tables = toy_target(seed=2)
    tree = toy_tree([2, 3], seed=22)
    p = target_pvalue(emitted_counts(accept_traversal, tree, tables), tables)
    assert p < P_FAIL, p


# ---------------------------------------------------------------------------------------------------------------------
# structural properties on random trees


@st.composite
def random_case(draw):
    n = draw(st.integers(1, 12))
    vocab = draw(st.integers(2, 8))
    parents, tokens, used = [-1], [draw(st.integers(0, vocab - 1))], {0: set()}
    for i in range(1, n):
        p = draw(st.integers(0, i - 1))
        free = [t for t in range(vocab) if t not in used[p]]
        if not free:
            break
        tok = draw(st.sampled_from(free))
        used[p].add(tok)
        used[i] = set()
        parents.append(p)
        tokens.append(tok)
    n = len(tokens)
    logq = [0.0] + [draw(st.one_of(st.floats(-6, 3), st.just(-math.inf))) for _ in range(n - 1)]
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(n, vocab, generator=g, dtype=torch.float64) ** 3
    w[torch.rand(n, vocab, generator=g) < draw(st.floats(0.0, 0.7))] = 0.0  # top-k style zeros
    w[torch.arange(n), torch.randint(vocab, (n,), generator=g)] += 0.05  # every row keeps some mass
    probs = (w / w.sum(-1, keepdim=True)).float()
    return Tree.from_lists(tokens, parents, logq), probs, seed


def _check_path(tree: Tree, acc: Acceptance):
    parents = tree.parents.tolist()
    assert acc.path[0] == 0
    assert all(parents[b] == a for a, b in zip(acc.path, acc.path[1:]))


@settings(max_examples=150, deadline=None)
@given(random_case())
def test_random_trees_properties(case):
    tree, probs, seed = case
    kids = tree.children()
    tokens = tree.tokens.tolist()
    for rule in (accept_target_only, accept_traversal):
        acc = rule(tree, probs, torch.Generator().manual_seed(seed))
        _check_path(tree, acc)
        leaf = acc.path[-1]
        assert probs[leaf, acc.bonus] > 0
        for a, b in zip(acc.path, acc.path[1:]):
            assert probs[a, tokens[b]] > 0  # a zero-probability child is never accepted
        if rule is accept_target_only:  # drawing a child's token moves there, so the bonus is no child of the leaf
            assert acc.bonus not in {tokens[c] for c in kids[leaf]}
        assert rule(tree, probs, torch.Generator().manual_seed(seed)) == acc  # reproducible
    greedy = accept_greedy(tree, probs)
    _check_path(tree, greedy)
    best = probs.argmax(-1).tolist()
    assert greedy.bonus == best[greedy.path[-1]]
    assert all(tokens[b] == best[a] for a, b in zip(greedy.path, greedy.path[1:]))


def test_traversal_rejects_duplicate_sibling_tokens():
    tree = Tree.from_lists([0, 1, 1], [-1, 0, 0])
    with pytest.raises(ValueError):
        accept_traversal(tree, torch.full((3, V), 1.0 / V), torch.Generator().manual_seed(0))


def test_inverse_cdf_host_and_device_paths_agree():
    """The device implementation (exercised here on CPU tensors) matches the host one, never picks a zero entry."""
    g = torch.Generator().manual_seed(5)
    for trial in range(200):
        row = torch.rand(7, generator=g, dtype=torch.float64)
        row[torch.rand(7, generator=g) < 0.5] = 0.0
        if trial % 3 == 0:
            row[-2:] = 0.0  # trailing zeros: an overflow must land on the last positive entry
        for u in (0.0, float(torch.rand(1, generator=g)), math.nextafter(1.0, 0.0)):
            host = accept_mod._inverse_cdf_host(row.numpy(), u)
            assert host == accept_mod._inverse_cdf_device(row, u)
            assert (host == -1) if row.sum() == 0 else row[host] > 0


def test_device_greedy_acceptance_equals_the_walk():
    """accept_greedy_tensors (fixed shapes, padded trees) picks the same path and bonus as accept_greedy."""
    gen = torch.Generator().manual_seed(7)
    vocab = 300
    for trial in range(60):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        parents = [-1] + [int(torch.randint(i, (1,), generator=gen)) for i in range(1, n)]
        tokens = torch.randperm(vocab, generator=gen)[:n]  # distinct tokens: no duplicate siblings
        tree = Tree(tokens, torch.tensor(parents), torch.zeros(n))
        logits = torch.randn(n, vocab, generator=gen)
        for i in range(1, n):  # plant agreement on most edges so that deep paths get accepted
            if float(torch.rand((), generator=gen)) < 0.7:
                logits[parents[i], tokens[i]] = 10.0 + float(torch.rand((), generator=gen))
        walk = accept_greedy(tree, logits)
        padded = tree.padded(n + trial % 5)
        pad_logits = torch.cat([logits, torch.randn(len(padded) - n, vocab, generator=gen)])
        path, length, bonus = accept_greedy_tensors(padded.tokens, padded.parents, pad_logits, padded.ancestor_mask)
        assert int(length) == len(walk.path) and path[: int(length)].tolist() == walk.path, trial
        assert (path[int(length):] == -1).all() and int(bonus) == walk.bonus, trial

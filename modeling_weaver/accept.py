"""Acceptance rules (docs/DESIGN.md §6): which root→node path of a tree is committed, and the next bonus token.

Every rule returns an :class:`Acceptance`: the accepted node indices ``path`` (root first) and a new ``bonus`` token.
The step commits ``len(path)`` tokens (the root, i.e. the previous bonus, plus the accepted drafts); the new bonus is
emitted but not yet processed by the target.

Sampling rules are *lossless*: for a fixed tree, the emitted sequence (path tokens after the root, then the bonus,
then whatever the target samples afterwards) is distributed exactly as if the target had sampled token by token from
``probs``. Their conditions differ:

* :func:`accept_target_only` is lossless for any tree (the drafter's probabilities are never used).
* :func:`accept_traversal` is lossless when, at every node, the children are the *full support* of the proposal ``q``
  (``q`` = ``exp(tree.logq)`` renormalised over the node's children) — true by construction here, since ``q`` is
  defined as the drafter's distribution restricted to the retained children.

Host/device: the rules gather the few numbers they need (one ``.tolist()`` of O(N) values) and walk the tree on the
host; the bonus is drawn by an inverse CDF over one ``[V]`` row on ``probs``' device (one scalar comes back). All
randomness comes from ``generator`` (a CPU :class:`torch.Generator`), drawn up front in one call, so results are
reproducible for a given seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .tree import Tree, children_of


@dataclass
class Acceptance:
    """Result of one acceptance step.

    Attributes:
        path: accepted node indices, root (0) first; ``len(path)`` tokens are committed this step.
        bonus: the new bonus token (chosen by the target at the last node of ``path``).
    """

    path: list[int]
    bonus: int


class DeviceAcceptance:
    """An acceptance rule that also runs on the device, so a fused greedy step can hold it (the acceptance replay's
    traces): ``tensors`` returns what :func:`accept_greedy_tensors` returns, ``__call__(tree, scores)`` the host
    :class:`Acceptance`, ``state()`` the tensors ``tensors`` advances in place (restored around a capture's
    warm-up)."""

    def tensors(self, tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor, ancestor_mask: torch.Tensor,
                logq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def __call__(self, tree: Tree, scores: torch.Tensor) -> Acceptance:
        raise NotImplementedError

    def state(self) -> list[torch.Tensor]:
        return []


# ---------------------------------------------------------------------------------------------------------------------
# helpers


def _node_table(tree: Tree, probs: torch.Tensor):
    """One device→host transfer of the per-node numbers the sampling rules need.

    Returns host lists ``tokens, parents, logq, p_node, total`` where ``p_node[i] = p(tokens[i] | parents[i])``
    (the parent's row, normalised by its sum) and ``total[i]`` is row i's sum (≈1).
    """
    if probs.dim() != 2 or probs.shape[0] != len(tree):
        raise ValueError(f"probs must be [N={len(tree)}, V], got {tuple(probs.shape)}")
    dev = probs.device
    tokens = tree.tokens.to(dev)
    parents = tree.parents.to(dev)
    # parents[0] == -1 indexes the last row: a harmless value, the root's p_node is never used.
    cols = [tokens.double(), parents.double(), tree.logq.to(dev).double()]
    cols += [probs[parents, tokens].double(), probs.sum(-1, dtype=torch.float32).double()]  # fp32 sum even for bf16
    tokens_f, parents_f, logq, p_raw, total = torch.stack(cols).tolist()  # the one sync
    tokens_l = [int(t) for t in tokens_f]
    parents_l = [int(p) for p in parents_f]
    p_node = [pr / total[p] for pr, p in zip(p_raw, parents_l)]
    return tokens_l, parents_l, logq, p_node, total


def _draw(row: torch.Tensor, u: float, scale: float = 1.0, tokens: list[int] = (), values: list[float] = ()) -> int:
    """Inverse-CDF draw with uniform ``u`` ∈ [0, 1) from ``scale · row`` with entries ``tokens`` set to ``values``.

    The row need not be normalised. Picks the first index whose cumulative mass exceeds ``u · total``, so a zero
    entry is never chosen (a rounding overflow falls back to the last positive entry); returns -1 if there is no mass.
    Host rows use numpy (no per-op dispatch overhead); device rows stay on their device and send back one sync's worth.
    """
    if row.device.type == "cpu":
        r = row.detach().double().numpy() * scale
        if tokens:
            r[list(tokens)] = values
        return _inverse_cdf_host(r, u)
    if not tokens:  # scale does not change an inverse-CDF draw
        return _inverse_cdf_device(row, u)
    r = row.double() * scale
    r[torch.tensor(tokens, device=r.device)] = torch.tensor(values, dtype=torch.float64, device=r.device)
    return _inverse_cdf_device(r, u)


def _inverse_cdf_host(r: np.ndarray, u: float) -> int:
    cdf = np.cumsum(r)
    total = float(cdf[-1])
    if not total > 0.0:
        return -1
    idx = int(np.searchsorted(cdf, total * u, side="right"))
    return idx if idx < r.shape[0] else int(np.flatnonzero(r > 0)[-1])


def _inverse_cdf_device(row: torch.Tensor, u: float) -> int:
    cdf = row.cumsum(0, dtype=torch.float64)
    total = cdf[-1:]
    idx = torch.searchsorted(cdf, total * u, right=True).clamp_(max=row.shape[0] - 1)
    idx_f, picked, total_f = torch.cat([idx.double(), row[idx].double(), total]).tolist()  # the one sync
    if not total_f > 0.0:
        return -1
    if picked > 0.0:
        return int(idx_f)
    return int((row > 0).nonzero()[-1, 0])  # u·total rounded up to the total: last positive entry


_BELOW_ONE = math.nextafter(1.0, 0.0)


def _uniforms(n: int, generator: torch.Generator | None) -> list[float]:
    return torch.rand(n, generator=generator, dtype=torch.float64).tolist()


# ---------------------------------------------------------------------------------------------------------------------
# greedy


def accept_greedy(tree: Tree, logits: torch.Tensor) -> Acceptance:
    """Greedy (temperature 0) acceptance.

    A child is accepted iff its token is the target's argmax at its parent; the walk descends from the root while some
    child matches, and the bonus is the argmax at the last accepted node. The output equals greedy decoding of the
    target because every committed token is exactly the argmax given its committed prefix.

    Args:
        tree: the verified tree (``N`` nodes).
        logits: ``[N, V]`` target logits (or any monotone transform, e.g. probabilities) at every node.
    """
    if logits.dim() != 2 or logits.shape[0] != len(tree):
        raise ValueError(f"logits must be [N={len(tree)}, V], got {tuple(logits.shape)}")
    dev = logits.device
    best, tokens, parents = torch.stack(
        [logits.argmax(-1), tree.tokens.to(dev), tree.parents.to(dev)]
    ).tolist()
    kids = children_of(parents)
    node, path = 0, [0]
    while True:
        want = best[node]
        nxt = next((c for c in kids[node] if tokens[c] == want), None)
        if nxt is None:
            return Acceptance(path, best[node])
        path.append(nxt)
        node = nxt


def accept_greedy_tensors(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor,
                          ancestor_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`accept_greedy` on the device, at fixed shapes (no host sync: a captured step can include it).

    A node is accepted iff every node on its root path (root excluded) carries the argmax of its parent; the deepest
    accepted node ends the path (padding roots never qualify: node 0 is not their ancestor).

    Args:
        tokens, parents: ``[N]`` the (possibly padded) tree; logits: ``[N, V]``; ancestor_mask: ``[N, N]``.
    Returns:
        ``path [N]`` (root..leaf, right-padded with -1), ``length`` (0-d, nodes on the path), ``bonus`` (0-d token).
    """
    best = logits.argmax(-1)
    correct = (tokens == best[parents.clamp(min=0)]) | (parents < 0)
    accepted = ancestor_mask[:, 0] & ~(ancestor_mask & ~correct[None]).any(1)
    depth = ancestor_mask.sum(1) - 1
    leaf = torch.where(accepted, depth, -1).argmax().view(1)
    return path_to_leaf(ancestor_mask, leaf, depth), depth[leaf][0] + 1, best[leaf][0]


def path_to_leaf(ancestor_mask: torch.Tensor, leaf: torch.Tensor, depth: torch.Tensor | None = None) -> torch.Tensor:
    """``[N]`` root..``leaf`` node indices right-padded with -1, on the device (``leaf`` a one-element tensor: a 0-d
    index would make PyTorch read it on the host, which a CUDA graph capture refuses; ``depth``: the nodes' depths
    if the caller has them)."""
    n = ancestor_mask.shape[0]
    depth = ancestor_mask.sum(1) - 1 if depth is None else depth
    slots = torch.where(ancestor_mask[leaf.view(1)][0], depth, n)  # node j goes to path[depth j]; others to a spill slot
    path = torch.full((n + 1,), -1, dtype=torch.long, device=ancestor_mask.device)
    path.scatter_(0, slots, torch.arange(n, device=ancestor_mask.device))
    return path[:n]


# ---------------------------------------------------------------------------------------------------------------------
# target-only ("naive") sampling


def accept_target_only(
    tree: Tree, probs: torch.Tensor, generator: torch.Generator | None = None
) -> Acceptance:
    """Target-only sampling (the "naive verification" of Traversal Verification, docs/DESIGN.md §6).

    At the current node draw ``x ~ p(node)``; if ``x`` is the token of one of the node's children move to that child,
    otherwise ``x`` is the bonus. Lossless for *any* tree: each emitted token is literally a draw from the target's
    conditional given the emitted prefix (moving to a child just reuses the verification already done for that
    prefix). The drafter's ``logq`` is not used.

    Implemented as an inverse CDF with the children's tokens ordered first: one uniform ``u`` per node; ``u`` below
    the children's cumulative mass selects a child, otherwise ``(u - S) / (1 - S)`` (``S`` = children's mass) draws
    the bonus from the row with the children's tokens zeroed — the same law as drawing from the full row.

    Args:
        tree: the verified tree (``N`` nodes). Duplicate sibling tokens are harmless (the first one is used).
        probs: ``[N, V]`` processed target distribution at every node (temperature/top-k/top-p applied; rows sum
            to 1, zeros allowed), on any device.
        generator: CPU generator for all randomness.
    """
    tokens, parents, _, p_node, _ = _node_table(tree, probs)
    kids = children_of(parents)
    u = _uniforms(len(tokens), generator)
    node, path = 0, [0]
    while True:
        seen: set[int] = set()
        cum, nxt, last_pos = 0.0, None, None
        for c in kids[node]:
            if tokens[c] in seen or p_node[c] <= 0.0:
                continue
            seen.add(tokens[c])
            cum += p_node[c]
            last_pos = c
            if u[node] < cum:
                nxt = c
                break
        if nxt is None:
            rest = 1.0 - cum
            if rest > 0.0:
                zeroed = sorted(seen)
                u_rest = min(max((u[node] - cum) / rest, 0.0), _BELOW_ONE)
                bonus = _draw(probs[node], u_rest, 1.0, zeroed, [0.0] * len(zeroed))
                if bonus >= 0:
                    return Acceptance(path, bonus)
            # The children carry (numerically) all the mass: u fell past the rounded sum.
            if last_pos is None:
                raise ValueError(f"probs row {node} has no mass")
            nxt = last_pos
        path.append(nxt)
        node = nxt


# ---------------------------------------------------------------------------------------------------------------------
# traversal verification


def _residual_alpha(m: float, alpha: float) -> float:
    """α of a node after one of its children was rejected: ``m / (m + 1 − α)``.

    ``m = Σ_x max(α·p(x) − q(x), 0)`` is the mass of the α-scaled target that the proposal did not cover. Before the
    rejection the node's subtree must yield "accept, next token x" with probability ``α·p(x)`` and "reject the node"
    with probability ``1 − α``. Trying a child drawn from ``q`` already yields ``min(q(x), α·p(x))`` for every x, so
    it is rejected with probability ``1 − (α − m) = m + 1 − α``; what is still owed is ``m`` of acceptance (with the
    residual law ``norm(max(αp − q, 0))``) and ``1 − α`` of rejection, hence the conditional acceptance weight
    ``m / (m + 1 − α)``. (Equals 1 at the root, where α = 1.)
    """
    den = m + 1.0 - alpha
    return m / den if den > 0.0 else 1.0  # den <= 0 only when m == 0 and α == 1: a rejection of probability 0


@dataclass
class _NodeState:
    """Traversal state of a node that has children (only the children's tokens are tracked explicitly).

    The node's current target row is ``scale · p0(x)`` for tokens that are not children's tokens and ``pt[c]`` for
    child c's token; ``q`` is the proposal over the still-active children (renormalised).
    """

    order: list[int]  # children, largest Gumbel key first
    pos: int  # next child of ``order`` to visit
    q: dict[int, float]  # active child -> q(c), sums to 1
    pt: dict[int, float]  # child -> current target prob of its token (children removed from q keep theirs)
    rest: float  # original mass of the non-child tokens, 1 − Σ_c p0(tok_c)
    scale: float = 1.0


def _reject(states: dict[int, _NodeState | None], alpha: list[float], parent: int, child: int) -> None:
    """Child ``child`` of ``parent`` was rejected: residualise the parent's target, update α, drop the child from q."""
    st = states[parent]
    a = alpha[parent]
    res = {c: max(a * pc - st.q.get(c, 0.0), 0.0) for c, pc in st.pt.items()}
    m = a * st.scale * st.rest + sum(res.values())
    alpha[parent] = _residual_alpha(m, a)
    if m > 0.0:  # m == 0 happens only with α == 0 (the node is then rejected surely) or with probability 0
        st.scale *= a / m
        st.pt = {c: r / m for c, r in res.items()}
    st.q.pop(child, None)
    z = sum(st.q.values())
    if z > 0.0:
        st.q = {c: qc / z for c, qc in st.q.items()}


def accept_traversal(
    tree: Tree, probs: torch.Tensor, generator: torch.Generator | None = None
) -> Acceptance:
    """Traversal verification (Weng et al., arXiv 2505.12398; docs/DESIGN.md §6): bottom-up, sequence-level acceptance.

    ``q(c | parent) = exp(tree.logq[c])`` renormalised over the parent's children (children with ``logq = -inf`` are
    outside q's support and are never visited). Siblings are visited in the order of Gumbel keys
    ``logq − log(−log u)``, i.e. as a sample without replacement from q — the tree is then distributed as the paper's
    sampled tree. Weights: ``α(root) = 1``, ``α(c) = min(1, α(parent) · p(c | parent) / q(c))`` (computed when c is
    first entered, from the parent's *current* α, p and q). Repeatedly descend through the best active child to a leaf
    ℓ; accept ``path_to(ℓ)`` if ℓ is the root or ``η < α(ℓ)``. Otherwise, at ℓ's parent P (current α, p, q):
    ``m = Σ_x max(α p(x) − q(x), 0)``, ``p ← max(α p − q, 0) / m`` (tokens outside the children keep α-scaled mass),
    ``α ← m / (m + 1 − α)``, drop ℓ from q and renormalise, deactivate ℓ, and continue from P. The bonus is drawn from
    the accepted leaf's current (possibly residual) row.

    Lossless when each node's children are the full support of q (see :func:`_residual_alpha` for the invariant: a
    node's subtree accepts "next token x" with probability ``α p(x)`` and rejects with ``1 − α``; at the root α = 1).
    On a chain it reduces to block verification. A child with ``α = 0`` is rejected without visiting its subtree (all
    of it would be rejected surely). Sibling tokens must be distinct.

    Args:
        tree: the verified tree (``N`` nodes), with ``logq`` the drafter's log-probabilities (need not be normalised).
        probs: ``[N, V]`` processed target distribution at every node (rows sum to 1, zeros allowed), any device.
        generator: CPU generator for all randomness.
    """
    tokens, parents, logq, p_node, total = _node_table(tree, probs)
    n = len(tokens)
    kids = children_of(parents)
    rnd = _uniforms(2 * n + 1, generator)
    keys = [lq - math.log(-math.log(r)) if r > 0.0 else -math.inf for lq, r in zip(logq, rnd)]  # Gumbel-perturbed
    eta = rnd[n : 2 * n]
    u_bonus = rnd[2 * n]

    live_edges = [(parents[i], tokens[i]) for i in range(1, n) if logq[i] > -math.inf]
    if len(set(live_edges)) != len(live_edges):
        raise ValueError("traversal verification needs distinct sibling tokens")

    def new_state(node: int) -> _NodeState | None:  # built on first entry: most of a big tree is never visited
        live = [c for c in kids[node] if logq[c] > -math.inf]
        if not live:
            return None
        top = max(logq[c] for c in live)
        w = {c: math.exp(logq[c] - top) for c in live}
        live = [c for c in live if w[c] > 0.0]  # q(c) == 0 (underflow): outside q's support, like -inf
        z = sum(w[c] for c in live)
        return _NodeState(
            order=sorted(live, key=lambda c: -keys[c]),
            pos=0,
            q={c: w[c] / z for c in live},
            pt={c: p_node[c] for c in live},
            rest=max(1.0 - sum(p_node[c] for c in live), 0.0),
        )

    states: dict[int, _NodeState | None] = {0: new_state(0)}
    alpha = [0.0] * n
    alpha[0] = 1.0
    node = 0
    while True:
        # Descend through the best active children to a leaf of the active tree.
        st = states[node]
        while st is not None and st.pos < len(st.order):
            c = st.order[st.pos]
            st.pos += 1
            a = min(1.0, alpha[node] * st.pt[c] / st.q[c])  # q[c] > 0: renormalising only increases it
            if a <= 0.0:
                _reject(states, alpha, node, c)  # its whole subtree would be rejected surely
                continue
            alpha[c] = a
            node = c
            st = states[node] = new_state(node)
        if node == 0 or eta[node] < alpha[node]:
            break
        parent = parents[node]
        _reject(states, alpha, parent, node)
        node = parent

    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    path.reverse()

    st = states[node]
    if st is None:
        bonus = _draw(probs[node], u_bonus)
    else:  # the leaf had children, all rejected: its row is the residual
        bonus = _draw(probs[node], u_bonus, st.scale / total[node], [tokens[c] for c in st.pt], list(st.pt.values()))
    if bonus < 0:  # residual lost all its mass to rounding; fall back to the target row
        bonus = _draw(probs[node], u_bonus)
    return Acceptance(path, bonus)

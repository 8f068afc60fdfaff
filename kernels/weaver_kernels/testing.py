"""Tree shapes and error measures shared by the kernel tests and ``scripts/bench_kernels.py``.

Trees are parent arrays (``parents[0] = -1``, ``parents[i] < i``: topological order). Nothing here needs Triton.
"""

from __future__ import annotations

import heapq
import math
import random

import torch


def chain_parents(T: int) -> list[int]:
    return [-1] + list(range(T - 1))


def star_parents(T: int) -> list[int]:
    return [-1] + [0] * (T - 1)


def random_parents(T: int, rng: random.Random) -> list[int]:
    """Random recursive tree: each node hangs under a uniformly drawn earlier node (topological, not depth-sorted)."""
    return [-1] + [rng.randrange(i) for i in range(1, T)]


def deep_path_parents(T: int, rng: random.Random, depth: int | None = None) -> list[int]:
    """One deep spine (``depth`` nodes below the root) plus short side branches hanging off it."""
    depth = T - 1 if depth is None else min(depth, T - 1)
    par = chain_parents(depth + 1)
    while len(par) < T:
        par.append(rng.randrange(len(par)))
    return par


def shuffled_topological(parents: list[int], rng: random.Random) -> list[int]:
    """The same tree renumbered in a random topological order (children may come long after, and before, cousins)."""
    T = len(parents)
    children = [[] for _ in range(T)]
    for i, p in enumerate(parents[1:], 1):
        children[p].append(i)
    order, ready = [], [0]
    while ready:
        n = ready.pop(rng.randrange(len(ready)))
        order.append(n)
        ready.extend(children[n])
    new = {old: i for i, old in enumerate(order)}
    return [-1] + [new[parents[old]] for old in order[1:]]


def best_first_parents(T: int, rng: random.Random, max_depth: int = 15, temperature: float = 1.0) -> list[int]:
    """A DDTree-style best-first tree of T nodes (root + T-1 drafts) from random per-depth marginals.

    Per depth, ranked log-probs come from a random logit vector (softmax with ``temperature``); a heap over
    cumulative log-prob pops the best path, pushing its next sibling and its first child (docs/DESIGN.md §4).
    Node order is pop order: topological, not depth-sorted. Depth ≤ ``max_depth``.
    """
    V = 64
    logp = []
    for _ in range(max_depth):
        x = [rng.gauss(0.0, 3.0) / temperature for _ in range(V)]
        m = max(x)
        lse = m + math.log(sum(math.exp(a - m) for a in x))
        logp.append(sorted((a - lse for a in x), reverse=True))
    parents = [-1]
    # heap entries: (-cum_logp, tie, depth, rank, parent_node, parent_cum)
    heap = [(-logp[0][0], 0, 1, 0, 0, 0.0)]
    tie = 1
    while len(parents) < T and heap:
        neg, _, d, r, par, par_cum = heapq.heappop(heap)
        node = len(parents)
        parents.append(par)
        if r + 1 < V:
            heapq.heappush(heap, (-(par_cum + logp[d - 1][r + 1]), tie, d, r + 1, par, par_cum))
            tie += 1
        if d < max_depth:
            heapq.heappush(heap, (neg - logp[d][0], tie, d + 1, 0, node, -neg))
            tie += 1
    return parents


def tree_of_kind(T: int, kind: str, rng: random.Random) -> tuple[list[int], list[int], int]:
    """``(parents, depths, deepest leaf)`` of a benchmark tree of ``T`` nodes: ``chain``, ``deep15`` (a depth-15
    spine, a block drafter's deepest tree, with side branches) or ``best_first`` (depth at most 15)."""
    if kind == "chain":
        parents = chain_parents(T)
    elif kind == "deep15":
        parents = deep_path_parents(T, rng, depth=15)
    else:
        parents = best_first_parents(T, rng, max_depth=15)
    dep = depths(parents)
    return parents, dep, max(range(T), key=lambda i: (dep[i], i))


def ancestor_mask(parents: list[int] | torch.Tensor, device=None) -> torch.Tensor:
    """``[T, T]`` bool ancestor-or-self mask."""
    par = parents.tolist() if isinstance(parents, torch.Tensor) else list(parents)
    T = len(par)
    M = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        j = i
        while j >= 0:
            M[i, j] = True
            j = par[j]
    return M.to(device)


def depths(parents: list[int]) -> list[int]:
    d = [0] * len(parents)
    for i in range(1, len(parents)):
        d[i] = d[parents[i]] + 1
    return d


def path_to(parents: list[int], leaf: int) -> list[int]:
    out = []
    while leaf >= 0:
        out.append(leaf)
        leaf = parents[leaf]
    return out[::-1]


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ in fp64 (inf if x has a NaN/inf)."""
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def gdn_inputs(B, T, H, HV, K, V, dtype, device="cpu", seed=0, l2norm_in_kernel=True):
    """Random GDN inputs in the model's regime: g = -exp(A)·softplus(·) < 0, β = sigmoid(·), q/k unit-ish."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    if not l2norm_in_kernel:  # the delta rule expects unit keys; normalise up front when the kernel won't
        q = torch.nn.functional.normalize(q, dim=-1)
        k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = -torch.exp(torch.randn(HV, generator=gen) * 0.5) * torch.nn.functional.softplus(
        torch.randn(B, T, HV, generator=gen) - 1.0
    )
    beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen))
    S0 = torch.randn(B, HV, K, V, generator=gen) * 0.5
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), g.to(device), beta.to(device), S0.to(device)


def forest_parents(T: int, rng: random.Random, roots: int = 3) -> list[int]:
    """Several trees in one topological order: nodes ``0..roots-1`` are roots, later nodes hang under earlier ones."""
    return [-1] * roots + [rng.randrange(i) for i in range(roots, T)]


def kda_inputs(B, T, H, HV, K, V, dtype, device="cpu", seed=0, l2norm_in_kernel=True):
    """Random KDA inputs in the model's regime: per-channel g = -exp(A)·softplus(·) < 0 (some channels nearly
    forgetting, some nearly keeping), β = sigmoid(·), q/k unit-ish."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    if not l2norm_in_kernel:  # the delta rule expects unit keys; normalise up front when the kernel won't
        q = torch.nn.functional.normalize(q, dim=-1)
        k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = -torch.exp(torch.randn(HV, 1, generator=gen) * 0.5) * torch.nn.functional.softplus(
        torch.randn(B, T, HV, K, generator=gen) * 3 - 1.0
    )
    beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen))
    S0 = torch.randn(B, HV, K, V, generator=gen) * 0.5
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), cast(g), cast(beta), cast(S0)

"""Proposal trees: one structure, three builders (chain, DDTree, Weaver). docs/DESIGN.md §4.

A tree's node 0 is the root, the bonus token the target chose last; draft nodes follow in topological order
(every parent before its children). The budget counts draft nodes, so a tree has at most ``budget + 1`` nodes.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import InitVar, dataclass

import torch
import weaver_kernels
from weaver_kernels.weaver_tree import cpu as native

from .modeling_weaver import WeaverPrompt
from .options import TreePolicy

DEFAULT_POLICY = TreePolicy()  # (frozen: a value, not a switch)


@dataclass
class Tree:
    """A proposal tree (batch 1).

    Attributes:
        tokens: ``[N]`` token ids; ``tokens[0]`` is the root (bonus token).
        parents: ``[N]`` parent index of each node, ``-1`` for the root; ``parents[i] < i``.
        logq: ``[N]`` log-probability of each node under its parent's proposal distribution (0 for the root).
            Traversal verification renormalises these over each node's children.
        check_root: check that node 0 is a root (a host read: :func:`with_root` and :meth:`padded`, which put the
            root there themselves, skip it so that building a tree never waits for the device).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    logq: torch.Tensor
    check_root: InitVar[bool] = True

    def __post_init__(self, check_root: bool):
        if self.tokens.dim() != 1 or self.tokens.shape != self.parents.shape:
            raise ValueError("tokens and parents must be 1-D tensors of the same length")
        if check_root and int(self.parents[0]) != -1:
            raise ValueError("node 0 must be the root (parent -1)")

    @classmethod
    def from_lists(cls, tokens, parents, logq=None, device=None) -> Tree:
        logq = [0.0] * len(tokens) if logq is None else logq
        return cls(
            torch.tensor(tokens, dtype=torch.long, device=device),
            torch.tensor(parents, dtype=torch.long, device=device),
            torch.tensor(logq, dtype=torch.float32, device=device),
        )

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_drafts(self) -> int:
        return len(self) - 1

    @functools.cached_property
    def depths(self) -> torch.Tensor:
        """``[N]`` depth of each node (root 0; padding nodes are roots too). Computed on the tree's device."""
        return node_depths(self.parents)

    @functools.cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """``[N, N]`` bool, ``mask[i, j]`` iff j is i or an ancestor of i (see :func:`ancestor_mask_of`)."""
        return ancestor_mask_of(self.parents)

    def padded(self, num_nodes: int) -> Tree:
        """This tree with padding nodes appended up to ``num_nodes`` (fixed shapes for captured steps).

        Padding nodes are extra roots (parent -1, token 0, ``logq`` -inf): no node has them as ancestor, and the
        acceptance rules, which walk down from node 0, never reach them.
        """
        if num_nodes < len(self):
            raise ValueError(f"a tree of {len(self)} nodes cannot be padded to {num_nodes}")
        if num_nodes == len(self):
            return self
        return Tree(*rooted(self.tokens[:1], (self.tokens[1:], self.parents[1:], self.logq[1:]), num_nodes),
                    check_root=False)

    def to(self, device) -> Tree:
        """This tree on ``device`` (itself when it is there already)."""
        if self.tokens.device == torch.device(device):
            return self
        return Tree(self.tokens.to(device), self.parents.to(device), self.logq.to(device), check_root=False)

    def children(self) -> list[list[int]]:
        """Children of every node, in node order."""
        return children_of(self.parents.tolist())

    def path_to(self, node: int) -> list[int]:
        """Node indices root..node."""
        parents = self.parents.tolist()
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        return path[::-1]


def ancestor_mask_of(parents: torch.Tensor) -> torch.Tensor:
    """``[N, N]`` bool ancestor-or-self mask of a parent vector ``[N]`` (-1 = root), on its device.

    No host sync and fixed shapes (CUDA graphs can capture it). Pointer doubling: after round k each row holds the
    ancestors less than ``2^k`` up and ``jump`` the one ``2^k`` up, so ``ceil(log2 N)`` rounds of row gathers cover
    every ancestor in O(N² log N) bool work (the tree kernels take the dense mask).
    """
    n = parents.shape[0]
    nodes = torch.arange(n, device=parents.device)
    # row n: a sentinel with no ancestors, where every jump past a root lands
    reach = torch.cat([nodes[:, None] == nodes[None], torch.zeros(1, n, dtype=torch.bool, device=parents.device)])
    jump = torch.cat([torch.where(parents >= 0, parents, n), parents.new_full((1,), n)])
    for _ in range(max(1, math.ceil(math.log2(max(n, 2))))):
        reach = reach | reach[jump]
        jump = jump[jump]
    return reach[:n]


def node_depths(parents: torch.Tensor) -> torch.Tensor:
    """``[N]`` depth of each node of a parent vector (roots 0), on its device, in O(N log N) (pointer jumping)."""
    n = parents.shape[0]
    depth = (parents >= 0).long()
    jump = torch.where(parents >= 0, parents, torch.arange(n, device=parents.device))
    for _ in range(max(1, math.ceil(math.log2(max(n, 2))))):
        depth = depth + torch.where(jump == torch.arange(n, device=parents.device), 0, depth[jump])
        jump = jump[jump]
    return depth


def children_of(parents: list[int]) -> list[list[int]]:
    """Children of every node from a host list of parents (-1 for the root), in node order."""
    kids: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p >= 0:
            kids[p].append(i)
    return kids


def rooted(root, drafts: tuple[torch.Tensor, torch.Tensor, torch.Tensor], num_nodes: int | None = None):
    """``tokens, parents, logq`` of a whole tree: ``root`` (an int, or a one-element tensor on the device), a
    builder's draft nodes (parent 0 = the root), then padding roots (token 0, parent -1, ``logq`` -inf) up to
    ``num_nodes`` — see :meth:`Tree.padded`. Device ops only when ``root`` is a tensor (captured steps)."""
    tokens, parents, logq = drafts if num_nodes is None else padded_drafts(drafts, num_nodes - 1)
    root = torch.as_tensor(root, dtype=torch.long, device=tokens.device).view(1)
    return (torch.cat([root, tokens]), torch.cat([parents.new_full((1,), -1), parents]),
            torch.cat([logq.new_zeros(1), logq]))


def padded_drafts(drafts: tuple[torch.Tensor, torch.Tensor, torch.Tensor], size: int):
    """A builder's draft nodes with padding roots (token 0, parent -1, ``logq`` -inf) appended up to ``size``."""
    tokens, parents, logq = drafts
    extra = size - tokens.shape[0]
    if extra < 0:
        raise ValueError(f"{tokens.shape[0]} drafts and the root do not fit {size + 1} nodes")
    return (torch.cat([tokens, tokens.new_zeros(extra)]), torch.cat([parents, parents.new_full((extra,), -1)]),
            torch.cat([logq, logq.new_full((extra,), float("-inf"))]))


def most_probable(scores: torch.Tensor, depths: torch.Tensor, k: int):
    """``topk`` of path scores, shallower first among equal scores (a token of probability 1 gives a child its
    parent's score): parents then always precede their children and are never cut off at the boundary."""
    return (scores.double() - 1e-12 * depths.double()).topk(k)


def subtree(tree: Tree, keep: list[int]) -> Tree:
    """The root of ``tree`` and its nodes ``keep`` (indices, ancestors of each included), renumbered in the tree's
    order: still topological, ``logq`` unchanged (traversal verification renormalises over the children kept)."""
    index = [0] + sorted(keep)
    number = {old: new for new, old in enumerate(index)}
    parents = tree.parents.tolist()
    picked = torch.tensor(index, device=tree.tokens.device)
    return Tree(tree.tokens[picked], torch.tensor([-1] + [number[parents[i]] for i in index[1:]],
                                                  device=tree.tokens.device), tree.logq[picked], check_root=False)


def with_root(root, drafts: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> Tree:
    """A :class:`Tree` from a builder's draft nodes (``tokens, parents, logq``; parent 0 = the root) and the root."""
    return Tree(*rooted(root, drafts), check_root=False)


def tree_drafts(mode: str, root, draft_hidden: torch.Tensor, draft_logits: torch.Tensor, budget: int, weaver=None,
                last_hidden: torch.Tensor | None = None, embed_tokens=None, lm_head_weight=None, node_table=None,
                policy: TreePolicy = DEFAULT_POLICY):
    """The draft nodes of one step's tree in ``mode`` (``chain``, ``ddtree`` or ``weaver``), on the device.

    Weaver trees also need the Weaver, the target's final hidden state before the block (``last_hidden``, its prompt
    with the drafter's ``draft_hidden``), the target's embedding and lm_head weight, and follow ``policy`` (and may
    take the Weaver's ``node_table``, see :func:`weaver_tree_tensors`). Returns what the
    ``*_tensors`` builders return; :func:`with_root` makes the :class:`Tree`.
    """
    if mode == "chain":
        return chain_tree_tensors(draft_logits, budget)
    if mode == "ddtree":
        return ddtree_tensors(draft_logits, budget)
    depth = min(draft_hidden.shape[0], weaver.config.K)
    prompt = PromptInputs(last_hidden[None], draft_hidden[None, :depth])
    return weaver_tree_tensors(root, weaver, prompt, draft_logits, embed_tokens, lm_head_weight, budget,
                               node_table=node_table, policy=policy)


def chain_tree(root: int, draft_logits: torch.Tensor, budget: int) -> Tree:
    """Plain DFlash: the argmax of each block position, as a single path of ``min(budget, depth)`` drafts.

    Args:
        root: the bonus token.
        draft_logits: ``[D, V]`` DFlash marginal logits for depths ``1..D``.
    """
    return with_root(root, chain_tree_tensors(draft_logits, budget))


def chain_tree_tensors(draft_logits: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chain's draft nodes on the device (see :func:`ddtree_tensors` for the return convention)."""
    best = torch.log_softmax(draft_logits[:budget].float(), dim=-1).max(dim=-1)
    return best.indices, torch.arange(best.indices.shape[0], device=draft_logits.device), best.values


def ddtree(root: int, draft_logits: torch.Tensor, budget: int) -> Tree:
    """DDTree: best-first over the per-depth marginals (optimal under the factorised distribution).

    The tree of ``budget`` drafts is the ``budget`` most probable token paths (prefix-closed, since extending a path
    never raises its probability), found on the device by :func:`ddtree_tensors`. Nodes come in descending path
    probability (parents first). Fewer drafts than ``budget`` exist only when ``depth × vocab`` is smaller; the rest
    are padding roots (:meth:`Tree.padded`), never accepted.
    """
    return with_root(root, ddtree_tensors(draft_logits, budget))


@functools.lru_cache(maxsize=None)  # never evicted: captured graphs keep reading these tensors
def _ddtree_pairs(budget: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slot, rank)`` index pairs with ``(slot + 1)(rank + 1) <= budget``: the candidates of a DDTree level that
    can be among its ``budget`` best (built once per shape, in warm-up runs before any capture; constants of a
    captured or compiled step)."""
    pairs = [(i, j) for j in range(k) for i in range(budget // (j + 1))]
    slot, rank = zip(*sorted(pairs))
    with torch.inference_mode(False):  # (a first call under inference_mode must not make inference tensors)
        return (torch.tensor(slot, dtype=torch.long, device=device),
                torch.tensor(rank, dtype=torch.long, device=device))


def ddtree_tensors(draft_logits: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The DDTree drafts at fixed shapes, without a host sync (a captured draft step can include it).

    Level by level, the ``budget`` best paths of depth d+1 are the best of (kept depth-d paths) × (top-k tokens of
    depth d+1): a path in the global top-``budget`` has its parent there too. The global top-``budget`` over all levels
    is the tree.

    Args:
        draft_logits: ``[D, V]`` DFlash marginal logits for depths ``1..D``.
    Returns:
        ``tokens, parents, logq`` of the ``budget`` draft nodes (node i of the tree is entry i-1; parent 0 = root);
        missing nodes have parent -1 and ``logq`` -inf.
    """
    depth_max, vocab = draft_logits.shape
    k = min(budget, vocab)
    device = draft_logits.device
    top = torch.log_softmax(draft_logits.float(), dim=-1).topk(k, dim=-1)  # [D, k]
    neg_inf = float("-inf")
    # Level d keeps `budget` paths: score, token rank, parent slot in level d-1 (-1 for depth 1).
    scores = torch.full((budget,), float("-inf"), device=device)
    scores[:k] = top.values[0]
    ranks = torch.zeros(budget, dtype=torch.long, device=device)
    ranks[:k] = torch.arange(k, device=device)
    levels = [(scores, ranks, torch.full((budget,), -1, dtype=torch.long, device=device))]
    slot_of, rank_of = _ddtree_pairs(budget, k, device)
    for d in range(1, depth_max):
        # Kept paths and tokens are both sorted, so (slot i, rank j) has (i+1)(j+1) - 1 candidates at least as good:
        # past the budget it is never needed. The level's top-budget is taken over the ≈ budget·ln(budget) others
        # (280 instead of 4096 at budget 64).
        best = (levels[-1][0][slot_of] + top.values[d][rank_of]).topk(budget)
        levels.append((best.values, rank_of[best.indices], slot_of[best.indices]))
    all_scores = torch.stack([lv[0] for lv in levels])  # [D, budget]
    depth_of = torch.arange(depth_max, device=device)[:, None].expand(-1, budget)
    picked = most_probable(all_scores.flatten(), depth_of.flatten(), budget)  # global best paths, descending
    depth, slot = picked.indices // budget, picked.indices % budget
    valid = picked.values > neg_inf
    # Final node number (1-based; 0 = root) of every (level, slot) picked, to map parents.
    number = torch.zeros(depth_max * budget, dtype=torch.long, device=device)
    number[picked.indices] = torch.arange(1, budget + 1, device=device)
    parent_slot = torch.stack([lv[2] for lv in levels])[depth, slot]
    parent_index = ((depth - 1).clamp(min=0) * budget + parent_slot.clamp(min=0))
    parents = torch.where(depth == 0, 0, number[parent_index])
    rank = torch.stack([lv[1] for lv in levels])[depth, slot]
    tokens = top.indices[depth, rank]
    logq = top.values[depth, rank]
    return (torch.where(valid, tokens, 0), torch.where(valid, parents, -1),
            torch.where(valid, logq, neg_inf))


def weaver_tree(
    root: int,
    weaver,
    prompt,
    draft_logits: torch.Tensor,
    embed_tokens: torch.nn.Module,
    lm_head_weight: torch.Tensor,
    budget: int,
    children_per_node: int | None = None,
    width: int | None = None,
    spine: bool | None = None,
    rounds: int | None = None,
    policy: TreePolicy = DEFAULT_POLICY,
) -> Tree:
    """A Weaver tree (spine or best-first rounds, see :func:`weaver_tree_tensors`)."""
    return with_root(root, weaver_tree_tensors(root, weaver, prompt, draft_logits, embed_tokens, lm_head_weight,
                                               budget, children_per_node, width, spine=spine, rounds=rounds,
                                               policy=policy))


def weaver_tree_tensors(
    root,
    weaver,
    prompt,
    draft_logits: torch.Tensor,
    embed_tokens: torch.nn.Module,
    lm_head_weight: torch.Tensor,
    budget: int,
    children_per_node: int | None = None,
    width: int | None = None,
    node_table: torch.Tensor | None = None,
    spine: bool | None = None,
    rounds: int | None = None,
    policy: TreePolicy = DEFAULT_POLICY,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Weaver tree from batched expansion rounds over the frontier (docs/DESIGN.md §4), on the device.

    Best-first rounds (``spine=False``, the paper's): the root is expanded first; then each round turns the ``width``
    best frontier entries (cumulative log-prob) into tree nodes and runs one batched Weaver node step on them, which
    publishes each node's top ``children_per_node`` (default ``policy.children_per_node``) pool candidates (none for
    nodes at the maximum depth) to the frontier — but for the nodes that fill the budget, whose children could not
    join the tree.
    ``ceil(budget / width)`` rounds fill the budget (``width`` default: the widest that still leaves at least as many
    rounds as depths, so that a path can reach the maximum depth); missing nodes (an exhausted frontier) are padding
    roots. Every shape is fixed by ``budget`` and ``width`` and nothing waits for the host, so a captured step can
    include the whole build.

    With ``spine`` (default ``policy.spine``) the depth comes first and the rounds are few: the first round runs the
    root together with the chain of DFlash's top-1 tokens (the pool's first candidate at every depth, as a plain DFlash
    chain; its deepest node is not stepped, as its step would publish nothing), all in one batched node step, since a
    node's step needs only its ancestors' tokens. Then ``rounds`` rounds (default ``policy.rounds_on(device, budget)``)
    of ``width`` (default ``policy.spine_width``) frontier entries each; the tree is the ``budget`` most probable paths
    among every node stepped and every frontier candidate (:func:`best_known`), so spine nodes the Weaver finds unlikely
    are left out; the root also offers its next best candidates as leaves, up to ``policy.root_children`` children in
    all. Depth no longer costs rounds: a budget-64 tree takes 1 + 4 node steps instead of 16. The price: off the spine,
    a path can follow the Weaver's own choices for at most ``rounds + 1`` tokens (best-first rounds: to the maximum
    depth), which costs some acceptance on text accepted deeply (docs/DESIGN.md §4). A round may also take a frontier
    entry at the maximum depth, whose step adds nothing (it publishes no candidates); at maximum depth 1 the spine's
    step, of the root alone, is the only one.

    Args:
        root: the bonus token (an int, or a 0-d or one-element tensor on the device).
        weaver: a :class:`~modeling_weaver.modeling_weaver.WeaverModel`.
        prompt: the Weaver prompt for this step (``weaver.encode_prompt``), or the :class:`PromptInputs` it is
            encoded from (on a CPU with the native kernels, inside the first node step).
        draft_logits: ``[D, V]`` DFlash marginal logits for depths ``1..D``; depth is capped at
            ``min(D, weaver.config.K, budget)`` (a tree of ``budget`` drafts reaches no deeper: on a CPU's budget of 5
            the spine step runs 5 nodes, not 15).
        node_table: optional ``weaver.node_input_table(embed_tokens.weight)``: node inputs gathered from it instead
            of computed each round.
        spine, rounds: see above.
        policy: the :class:`~modeling_weaver.options.TreePolicy` that the arguments left None default to.
    Returns:
        the draft nodes as :func:`ddtree_tensors` does.
    """
    device = draft_logits.device
    # (no node of a tree of `budget` drafts is deeper than `budget`: deeper spine nodes and their pools are waste)
    max_depth = min(draft_logits.shape[0], weaver.config.K, budget)
    if max_depth == 0:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return empty, empty, torch.zeros(0, device=device)
    # A node of depth d exists only after d rounds, so fewer than max_depth rounds would cap the tree's depth; as
    # wide as that allows (the largest width with ceil(budget / width) >= max_depth): each round is a chain of small
    # dependent kernels.
    spine = policy.spine if spine is None else spine
    if rounds is not None and (not spine or rounds < 0):
        raise ValueError(f"rounds ({rounds}) is the number of rounds after a spine: >= 0, with spine trees only")
    spine_nodes = max_depth if spine else 0
    if width is None:
        if spine:
            width = policy.spine_width or -(-budget // 8)
        else:
            width = budget if max_depth == 1 else max(1, (budget - 1) // (max_depth - 1))
    rounds = (policy.rounds_on(device, budget) if rounds is None else rounds) if spine else None
    if spine and max_depth == 1:
        rounds = 0  # every candidate is a leaf: stepping one adds nothing
    pool = min(policy.pool_on(device, weaver.config.candidate_pool_size), draft_logits.shape[-1])
    on_cpu = cpu_weaver(weaver, device, policy)
    # [D, pool]: children of depth d+1. On a CPU one native pass a row (torch's topk over the vocabulary was a large
    # part of a build); else topk in the logits' dtype, then fp32 (cheaper than topk over a widened copy)
    if on_cpu is not None and native.supports(draft_logits):  # (fp32 or bf16 rows it can read; else torch's)
        pool_logits, pool_ids = native.pool_topk(draft_logits[:max_depth], pool)
    else:
        pool_logits, pool_ids = draft_logits[:max_depth].topk(pool, dim=-1)
        pool_logits = pool_logits.float()
    pool_rows, lm_head_rows = pool_ids, lm_head_weight
    if lm_head_weight.device != device:  # (a target split over devices: only the pool's rows of its lm_head come over)
        lm_head_rows = lm_head_weight[pool_ids.flatten().to(lm_head_weight.device)].to(device)
        pool_rows = torch.arange(pool_ids.numel(), device=device).view_as(pool_ids)
    fan = min(policy.children_per_node if children_per_node is None else children_per_node, pool)
    n = 1 + spine_nodes + rounds * width if spine else budget + 1
    # (the dtype given: the Weaver's own property walks every parameter)
    cache = weaver.new_node_cache(n, device=device, dtype=weaver.proposal_in.weight.dtype)
    if isinstance(prompt, PromptInputs) and on_cpu is None:
        prompt = weaver.encode_prompt(prompt.target_hidden, prompt.draft_hidden.to(prompt.target_hidden.dtype))
    attend = None
    fused = policy.node_attention_on(device) and max(1 + spine_nodes, width) <= weaver_kernels.NODE_ATTENTION_MAX_ROWS
    if on_cpu is None and fused:
        # each layer's RoPE, slot writes and attention in one op (one launch per round on CUDA)
        prompt_kv = [(k[0].contiguous(), v[0].contiguous()) for k, v in zip(prompt.keys, prompt.values)]
        scale = weaver.config.head_dim ** -0.5

        def attend(i, qkv, positions, lo, rows):
            return weaver_kernels.node_attention(qkv, positions, *prompt_kv[i], cache.keys[i][0], cache.values[i][0],
                                                 rows, lo, weaver.config.rope_base, scale)
    if on_cpu is not None and spine and rounds == 0:  # one node step, its bookkeeping in one native call
        return _cpu_spine_tree(on_cpu, root, prompt, cache, pool_ids, pool_rows, pool_logits, lm_head_rows,
                               node_table, embed_tokens, fan,
                               budget // 2 if policy.root_children is None else policy.root_children, budget)
    lo, hi = 0, 1 + spine_nodes if spine else 1
    if on_cpu is not None and spine:  # (the same setup in one native call)
        tokens, parents, logq, depth, score, mask, f_score, f_token, f_logq = native.spine_buffers(
            root, pool_ids, spine_nodes, n, fan)
    else:
        tokens, parents, logq, depth, score, mask, f_score, f_token, f_logq = _build_buffers(
            root, pool_ids, spine_nodes if spine else 0, n, fan, device)
    # Each round expands the nodes made by the previous one: always the contiguous range lo..hi-1 (the root first),
    # so reads and writes of per-node rows are slices (views and plain copies instead of gathers and scatters). Its
    # bookkeeping — candidate scores, children to the frontier, the next nodes — is two weaver_kernels ops (two
    # Triton launches on CUDA, two native calls on a CPU; the torch reference elsewhere).
    # (with a spine every stepped node's children are candidates, the last round's too: the tree is picked after)
    while lo < hi:
        # The spine's deepest node is at the maximum depth: its step would publish nothing (its score comes from its
        # parent's row), so it is not stepped and its row of scores is a placeholder the expand op never publishes.
        stepped = hi - 1 if spine and lo == 0 and spine_nodes > 0 else hi
        d = depth[lo:stepped]
        x = (node_table[tokens[lo:stepped]] if node_table is not None
             else weaver.node_inputs(embed_tokens(tokens[lo:stepped])))
        if on_cpu is not None and isinstance(prompt, PromptInputs):
            prompt, query = on_cpu.first_step(prompt, cache, x, d + 1, lo, mask[lo:stepped])
        elif on_cpu is not None:
            query = on_cpu.step(prompt, cache, x, d + 1, lo, mask[lo:stepped])
        else:
            query = weaver.step(prompt, cache, x[None], d[None], slice(lo, stepped), mask[None, lo:stepped],
                                attend=attend)[0]
        cand = weaver_kernels.pool_scores(query, d.clamp(max=max_depth - 1), pool_rows, pool_logits, lm_head_rows)
        if stepped < hi:
            cand = torch.cat([cand, cand.new_zeros(hi - stepped, cand.shape[1])])
        if spine and lo == 0:  # (scores in hand: the root's leaves are picked from the same row)
            root_leaves = (_root_leaves if on_cpu is None else native.root_leaves)(
                cand[0], pool_ids[0], fan, budget // 2 if policy.root_children is None else policy.root_children)
        take = min(width, n - hi)
        weaver_kernels.weaver_expand(cand, pool_ids, tokens, parents, logq, depth, score, mask, f_score, f_token,
                                     f_logq, lo, hi, take, max_depth, spine_nodes if lo == 0 else 0)
        if not spine and hi + take >= n:  # the last nodes need no step: no children of theirs can join a full tree
            break
        lo, hi = hi, hi + take
    if spine:
        return (best_known if on_cpu is None else native.best_known)(tokens, parents, logq, depth, score, f_score,
                                                                      f_token, f_logq, budget, root_leaves)
    return tokens[1:], parents[1:], logq[1:]


@functools.lru_cache(maxsize=64)
def _prompt_rows(p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE positions ``[p]`` and causal masks ``[p, p]`` of a Weaver prompt's rows: constants, only read."""
    with torch.inference_mode(False):
        return torch.arange(p), torch.ones(p, p, dtype=torch.bool).tril()


@functools.lru_cache(maxsize=64)
def _spine_rows(spine: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE positions ``[spine]`` and ancestor masks ``[spine, spine + 1]`` of a spine step's nodes (the root and the
    chain but its deepest node, node i at depth i): constants, only read."""
    with torch.inference_mode(False):
        return torch.arange(1, spine + 1), torch.ones(spine, spine + 1, dtype=torch.bool).tril()


def _cpu_spine_tree(on_cpu, root, prompt, cache, pool_ids, pool_rows, pool_logits, lm_head_rows, node_table,
                    embed_tokens, fan: int, children: int, budget: int):
    """:func:`weaver_tree_tensors` of a spine tree with no rounds after the spine on a CPU with the native kernels:
    the one node step (:class:`CpuWeaver`), then ``weaver_kernels.weaver_tree.cpu.spine_tree`` (the same
    bookkeeping as the general loop's ops, in one call; a test keeps the two equal)."""
    spine = pool_ids.shape[0]
    tokens = torch.cat([torch.as_tensor(root, dtype=torch.long).view(1), pool_ids[: spine - 1, 0]])
    x = node_table[tokens] if node_table is not None else on_cpu.weaver.node_inputs(embed_tokens(tokens))
    positions, mask = _spine_rows(spine)
    if isinstance(prompt, PromptInputs):
        query = on_cpu.first_step(prompt, cache, x, positions, 0, mask)[1]
    else:
        query = on_cpu.step(prompt, cache, x, positions, 0, mask)
    return native.spine_tree(query, root, pool_ids, pool_rows, pool_logits, lm_head_rows, fan, children, budget)


def _build_buffers(root, pool_ids: torch.Tensor, spine: int, n: int, fan: int, device):
    """A Weaver build's buffers (see :func:`~weaver_kernels.weaver_expand_ref`): ``n`` nodes, the root first, then
    ``spine`` nodes: the chain of the pool's first candidates (node i at depth i); the rest padding roots; a frontier
    of ``n · fan`` empty entries (slot node·fan + j: the j-th best child candidate of that node)."""
    # No Python-number stores into device tensors here (`x[i] = 0.0` copies from the host, which a CUDA graph capture
    # refuses): fill_ and full take scalars without a copy.
    neg_inf = float("-inf")
    tokens = torch.zeros(n, dtype=torch.long, device=device)
    tokens[:1].copy_(torch.as_tensor(root, device=device).view(1))
    parents = torch.full((n,), -1, dtype=torch.long, device=device)
    logq = torch.full((n,), neg_inf, device=device)
    logq[:1].fill_(0.0)
    depth = torch.zeros(n, dtype=torch.long, device=device)
    score = torch.zeros(n, device=device)  # log-probability of the root→node path
    mask = torch.eye(n, dtype=torch.bool, device=device)
    if spine:
        hi = 1 + spine
        tokens[1:hi].copy_(pool_ids[:spine, 0])
        parents[1:hi].copy_(torch.arange(spine, device=device))
        depth[:hi].copy_(torch.arange(hi, device=device))
        mask[:hi, :hi].copy_(torch.ones(hi, hi, dtype=torch.bool, device=device).tril())
    frontier = (torch.full((n * fan,), neg_inf, device=device), torch.zeros(n * fan, dtype=torch.long, device=device),
                torch.zeros(n * fan, device=device))
    return (tokens, parents, logq, depth, score, mask, *frontier)


@dataclass
class PromptInputs:
    """What a Weaver prompt is encoded from (``WeaverModel.encode_prompt``'s arguments, batch 1; the drafter's hidden
    states in the drafter's dtype, cast to the target's as encoding them does): a Weaver build takes these in place of
    the prompt, and on a CPU encodes it inside its first node step (:meth:`CpuWeaver.first_step`)."""

    target_hidden: torch.Tensor
    draft_hidden: torch.Tensor


class CpuWeaver:
    """A Weaver's node steps on a CPU through the native kernels of ``weaver_kernels.weaver_tree.cpu``: the GEMMs
    through the Weaver's own linears (packed inside a generation), each stretch between two of them in one native
    call — the functions of ``WeaverModel.encode_prompt`` and ``WeaverModel.step`` (equal within rounding; tests keep
    them so), at a tenth of the torch calls."""

    def __init__(self, weaver):
        self.weaver = weaver
        self.scale = weaver.config.head_dim ** -0.5

    @staticmethod
    def _norm(norm, x, add=None):
        return native.rms_norm_bias(x, norm.weight, norm.bias, norm.eps, add=add)

    def _layers(self, x, attention):
        """The blocks over the rows ``x``: ``attention(i, qkv)`` gives layer i's heads' outputs for the last rows it
        keeps (the rows before them end there); returns ``out_norm`` of the rows kept."""
        blocks = self.weaver.blocks
        h = self._norm(blocks[0].norm_attn, x)
        for i, block in enumerate(blocks):
            attn = attention(i, block.qkv_proj(h))
            x = x[x.shape[0] - attn.shape[0]:]
            x, h = self._norm(block.norm_mlp, x, add=block.o_proj(attn))
            after = blocks[i + 1].norm_attn if i + 1 < len(blocks) else self.weaver.out_norm
            x, h = self._norm(after, x, add=block.down_proj(native.silu_mul(block.gate_up_proj(h))))
        return h

    def step(self, prompt, cache, x: torch.Tensor, positions: torch.Tensor, lo: int, mask: torch.Tensor
             ) -> torch.Tensor:
        """``WeaverModel.step`` (batch 1, slots ``lo..lo + M - 1``) with ``x [M, d_rank]``, ``positions [M]``
        (depth + 1) and ``mask [M, max_nodes]`` → ``[M, d_model]``."""
        weaver = self.weaver

        def attention(i, qkv):
            return native.node_attention(qkv, positions, prompt.keys[i][0].contiguous(),
                                         prompt.values[i][0].contiguous(), cache.keys[i][0], cache.values[i][0], mask,
                                         lo, weaver.config.rope_base, self.scale)

        return weaver.lm_head_query_in(self._layers(x, attention))

    def first_step(self, inputs: PromptInputs, cache, x: torch.Tensor, positions: torch.Tensor, lo: int,
                   mask: torch.Tensor):
        """``WeaverModel.encode_prompt`` of ``inputs``, then :meth:`step`: each layer's GEMMs over the prompt's rows
        and the nodes' together (a weight read once, not twice). The prompt rows attend causally among themselves and
        stop after the last layer's attention (their outputs are never read). Returns ``(prompt, queries)``."""
        weaver, norm = self.weaver, self.weaver.output_norm
        # (the features cast to the target's dtype, then to the Weaver's: as the Weaver's encoding casts them)
        draft = inputs.draft_hidden[0, : weaver.config.K]
        if draft.dtype != inputs.target_hidden.dtype:
            draft = draft.to(inputs.target_hidden.dtype)
        rows = weaver.proposal_in(native.prompt_norm(inputs.target_hidden[0].contiguous(), draft.contiguous(),
                                                     norm.weight, norm.bias, norm.eps, weaver.proposal_in.weight.dtype))
        p, heads, dim = rows.shape[0], weaver.config.num_heads, weaver.config.head_dim
        prompt_positions, causal = _prompt_rows(p)
        none = rows.new_empty(heads, 0, dim)
        keys = [rows.new_empty(heads, p, dim) for _ in weaver.blocks]
        values = [torch.empty_like(k) for k in keys]

        def attention(i, qkv):
            last = i + 1 == len(keys)
            own = native.node_attention(qkv[:p], prompt_positions, none, none, keys[i], values[i], causal, 0,
                                        weaver.config.rope_base, self.scale, want_output=not last)
            nodes = native.node_attention(qkv[p:], positions, keys[i], values[i], cache.keys[i][0],
                                          cache.values[i][0], mask, lo, weaver.config.rope_base, self.scale)
            return nodes if last else torch.cat([own, nodes])

        queries = weaver.lm_head_query_in(self._layers(torch.cat([rows, x]), attention))
        return WeaverPrompt([k[None] for k in keys], [v[None] for v in values]), queries


def cpu_weaver(weaver, device, policy: TreePolicy = DEFAULT_POLICY) -> CpuWeaver | None:
    """The :class:`CpuWeaver` of ``weaver`` where its build runs on a CPU through the native kernels (on a CPU, the
    Weaver there in fp32 or bf16, ``policy.node_attention_on``, and the kernels built), else None."""
    weight = weaver.proposal_in.weight  # (not weaver.device / .dtype: they walk every parameter)
    if (torch.device(device).type != "cpu" or weight.device.type != "cpu"
            or weight.dtype not in (torch.float32, torch.bfloat16) or not policy.node_attention_on(device)
            or not native.available()):
        return None
    return CpuWeaver(weaver)


def _root_leaves(cand: torch.Tensor, ids: torch.Tensor, fan: int, children: int):
    """A spine tree's root's candidates after the ``fan`` it published, up to ``children`` in all, as ``(score,
    token, logq)`` for :func:`best_known` (leaves: never stepped); None when there are none. ``cand [P]`` the root's
    scores, ``ids [P]`` its pool, whose column 0 is the spine child (a node already). Ordered as the expand op orders
    them (stable: among equal scores the lowest index first), so the first ``fan`` are the ones published. (The op
    has sorted this row too, inside its kernel: one row of P here is cheaper than a wider kernel.)"""
    end = min(children, cand.shape[0] - 1)
    if end <= fan:
        return None
    logp = torch.log_softmax(cand.float(), dim=-1)[1:]
    values, order = logp.sort(descending=True, stable=True)
    values = values[fan:end]
    return values, ids[1:][order[fan:end]], values  # (the root's path score is 0: a leaf's score is its logq)


def best_known(tokens: torch.Tensor, parents: torch.Tensor, logq: torch.Tensor, depth: torch.Tensor,
               score: torch.Tensor, f_score: torch.Tensor, f_token: torch.Tensor, f_logq: torch.Tensor,
               budget: int, root_leaves: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``budget`` most probable paths among a Weaver build's nodes (``[n]`` buffers of
    :func:`~weaver_kernels.weaver_expand_ref`, node 0 the root) and its frontier (``[n · fan]``), plus ``root_leaves``
    (``(score, token, logq)``: more children of the root, :func:`_root_leaves`), as draft nodes (see
    :func:`ddtree_tensors`), most probable first. Fixed shapes, no host sync.

    A path's score never exceeds its parent's, and ties go to the shallower node, so the set is prefix-closed and in
    topological order.
    """
    n = tokens.shape[0]
    fan = f_score.shape[0] // n
    neg_inf = float("-inf")
    f_parent = torch.arange(n, device=tokens.device).repeat_interleave(fan)
    if root_leaves is not None:  # more frontier entries, all of them the root's
        f_score, f_token, f_logq = (torch.cat([f, e]) for f, e in zip((f_score, f_token, f_logq), root_leaves))
        f_parent = torch.cat([f_parent, f_parent.new_zeros(root_leaves[0].shape[0])])
    keys = torch.cat([torch.where(parents[1:] >= 0, score[1:], neg_inf), f_score])
    deep = torch.cat([depth[1:], depth[f_parent] + 1])
    k = min(budget, keys.shape[0])
    picked = most_probable(keys, deep, k)
    valid = picked.values > neg_inf
    is_node = picked.indices < n - 1
    node = (picked.indices + 1).clamp(max=n - 1)
    slot = (picked.indices - (n - 1)).clamp(min=0)
    parent = torch.where(is_node, parents[node], f_parent[slot])
    # node number in the tree (1-based, root 0) of every node picked; slot n takes the rest
    number = torch.zeros(n + 1, dtype=torch.long, device=tokens.device)
    number.scatter_(0, torch.where(is_node & valid, node, n), torch.arange(1, k + 1, device=tokens.device))
    drafts = (torch.where(valid, torch.where(is_node, tokens[node], f_token[slot]), 0),
              torch.where(valid, number[parent.clamp(min=0)], -1),
              torch.where(valid, torch.where(is_node, logq[node], f_logq[slot]), neg_inf))
    return padded_drafts(drafts, budget)  # (fewer candidates than the budget: padding roots)


# The most draft nodes a tree may hold on any device: a step's masks are dense [N, N] (the tree kernels' interface)
# and its target pass grows with N², so past this a step costs more than any block of draft depths can repay.
MAX_TREE_BUDGET = 4096
# Share of the device's free memory one step's tree-sized buffers may take (the rest: weights, caches, slack).
TREE_MEMORY_SHARE = 0.25


def _free_memory(device: torch.device) -> int:
    """Bytes free on ``device`` now: the CUDA allocator's view, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_tree_budget(device) -> int:
    """The tree budget a generation on ``device`` uses when none is given: 5 on CPU, where a verify's few-row GEMMs
    cost in steps of their row blocks (up to 6 rows, 5 drafts and the root, cost about what one does; a seventh
    starts the next block, BENCHMARKS.md), 64 on accelerators, where 65 nodes cost about one AR step."""
    return 5 if torch.device(device).type == "cpu" else 64


def default_tree_mode(device, weaver=None) -> str:
    """The tree mode a generation on ``device`` uses when none is given: Weaver trees on accelerators when a Weaver is
    given, DDTree otherwise. On a CPU a Weaver build costs about twice DDTree's (through the native kernels) and at
    the budgets a CPU verifies its acceptance is level with DDTree's (BENCHMARKS.md)."""
    return "weaver" if weaver is not None and torch.device(device).type != "cpu" else "ddtree"


def max_tree_budget(target, device=None) -> int:
    """The largest ``tree_budget`` a step of ``target`` takes on ``device`` (default: the target's).

    The least of: :data:`MAX_TREE_BUDGET`; for hybrid targets on CUDA, the GDN tree kernel's node limit
    (``weaver_kernels.max_tree_nodes``, root included); and what fits in :data:`TREE_MEMORY_SHARE` of the free memory,
    counting per step the [N, N] bool masks (the ancestor mask and its doubling, ≈ 3 N² bytes), on CPU the reference
    tree attention's fp32 scores over the tree (4 H N² bytes a layer, H query heads; CUDA's kernel keeps them in
    tiles), and the target's logits with their processed and normalised copies (12 V N bytes, fp32).
    """
    return tree_budget_bound(target, device)[0]


def tree_budget_bound(target, device=None) -> tuple[int, str]:
    """:func:`max_tree_budget` and the reason for it (which bound is the least)."""
    from .target import HYBRID_GDN, text_config  # (target imports this module)

    device = torch.device(device) if device is not None else next(target.parameters()).device
    config = text_config(target.config)
    bounds = [(MAX_TREE_BUDGET, f"tree.MAX_TREE_BUDGET = {MAX_TREE_BUDGET}")]
    hybrid = getattr(target.config, "model_type", None) in HYBRID_GDN
    nodes = weaver_kernels.max_tree_nodes(device) if hybrid else None
    if nodes is not None:
        bounds.append((nodes - 1, f"the GDN tree kernel verifies at most {nodes} nodes (budget + root) on {device}"))
    heads = getattr(config, "num_attention_heads", 1) if device.type != "cuda" else 0
    a, b = 3 + 4 * heads, 12 * target.get_output_embeddings().weight.shape[0]  # bytes per step: a N² + b N
    memory = TREE_MEMORY_SHARE * _free_memory(device)
    fits = int((-b + math.sqrt(b * b + 4 * a * memory)) / (2 * a))
    bounds.append((fits, f"a step's tree buffers ({a} N² + {b} N bytes) must fit in {TREE_MEMORY_SHARE:.0%} of the "
                         f"{memory / TREE_MEMORY_SHARE / 2**30:.1f} GiB free on {device}"))
    return min(bounds)

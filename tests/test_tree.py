"""Tree builders: DDTree on the device equals best-first search with a heap; fixed shapes, parents first."""

import heapq

import torch

from modeling_weaver.tree import ddtree, ddtree_tensors


def best_first_reference(root, draft_logits, budget):
    """Heap best-first over (depth, rank): pop the most probable path, push its next sibling and its first child."""
    depth_max = draft_logits.shape[0]
    k = min(budget, draft_logits.shape[-1])
    top = torch.log_softmax(draft_logits.float(), dim=-1).topk(k, dim=-1)
    top_logp, top_ids = top.values.tolist(), top.indices.tolist()
    tokens, parents, logq = [root], [-1], [0.0]
    heap = [(-top_logp[0][0], 0, 0, 0, 0, 0.0)]
    counter = 1
    while heap and len(tokens) <= budget:
        neg, _, d, r, parent, parent_score = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(top_ids[d][r])
        parents.append(parent)
        logq.append(top_logp[d][r])
        if r + 1 < k:
            heapq.heappush(heap, (-(parent_score + top_logp[d][r + 1]), counter, d, r + 1, parent, parent_score))
            counter += 1
        if d + 1 < depth_max:
            heapq.heappush(heap, (neg - top_logp[d + 1][0], counter, d + 1, 0, node, -neg))
            counter += 1
    return tokens, parents, logq


def test_ddtree_equals_heap_best_first():
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        depth = int(torch.randint(1, 16, (1,), generator=gen))
        vocab = int(torch.randint(2, 60, (1,), generator=gen))
        budget = int(torch.randint(1, 70, (1,), generator=gen))
        logits = torch.randn(depth, vocab, generator=gen) * float(5 * torch.rand((), generator=gen))
        tokens, parents, logq = best_first_reference(7, logits, budget)
        tree = ddtree(7, logits, budget)
        n = len(tokens)
        assert len(tree) == budget + 1, trial  # fixed size: missing nodes are padding roots
        assert tree.tokens[:n].tolist() == tokens and tree.parents[:n].tolist() == parents, trial
        assert torch.allclose(tree.logq[:n], torch.tensor(logq)), trial
        assert (tree.parents[n:] == -1).all() and torch.isinf(tree.logq[n:]).all(), trial


def test_ddtree_keeps_parents_first_when_a_token_is_certain():
    logits = torch.full((6, 50), -100.0)
    logits[:, 3] = 100.0  # log-prob 0.0 in fp32: children tie with their parents
    logits[2, 4] = 99.0
    tokens, parents, logq = ddtree_tensors(logits, 12)
    assert all(p < i + 1 for i, p in enumerate(parents.tolist()))  # entry i is node i + 1
    assert (parents >= 0).all()


def test_trees_from_builders_never_wait_for_the_device():
    """Building a tree from a builder's drafts (`with_root`, `padded`) reads nothing on the host — a read would make
    the host wait for the draft step before it can queue the verify — while a hand-built tree is still checked."""
    import pytest
    from test_captured import CaptureRules

    from modeling_weaver.tree import Tree, with_root

    logits, root = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)), torch.tensor([7])
    with CaptureRules():  # refuses host reads of tensor values
        tree = with_root(root, ddtree_tensors(logits, 9)).padded(16)
    assert len(tree) == 16 and int(tree.parents[0]) == -1
    with pytest.raises(ValueError, match="node 0 must be the root"):
        Tree(torch.tensor([1, 2]), torch.tensor([1, -1]), torch.zeros(2))


def _tiny_weaver_build():
    """``(weaver, build(policy, budget))``: a Weaver tree builder over fixed random inputs of a tiny Llama pair."""
    from test_generate import make_drafters
    from tiny_targets import TINY_TARGETS

    from modeling_weaver.tree import weaver_tree_tensors

    target = TINY_TARGETS["llama"]()
    _, weaver = make_drafters(target)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, target.config.hidden_size, generator=gen)
    logits = torch.randn(7, target.config.vocab_size, generator=gen)
    prompt = weaver.encode_prompt(torch.randn(1, target.config.hidden_size, generator=gen), hidden[None])

    def build(policy, budget, draft_logits=None):
        with torch.no_grad():
            return weaver_tree_tensors(3, weaver, prompt, logits if draft_logits is None else draft_logits,
                                       target.get_input_embeddings(), target.get_output_embeddings().weight, budget,
                                       policy=policy)
    build.logits = logits
    return weaver, build


def test_rounds_after_the_spine_follow_the_device(monkeypatch):
    """TreePolicy.spine_rounds None: 4 rounds after the spine on CUDA; elsewhere none for trees of up to 5 drafts (a
    CPU round re-reads the Weaver's weights for one node) and one for larger ones; a value given is used everywhere.
    A CPU build steps the spine round and then that many rounds."""
    from modeling_weaver.options import TreePolicy

    assert TreePolicy().rounds_on("cpu", 5) == 0 and TreePolicy().rounds_on("cpu", 16) == 1 == TreePolicy().rounds_on(
        "cpu") and TreePolicy().rounds_on(torch.device("cuda", 0), 5) == 4
    assert TreePolicy(spine_rounds=3).rounds_on("cpu") == 3 == TreePolicy(spine_rounds=3).rounds_on("cuda")
    from modeling_weaver.tree import CpuWeaver

    weaver, build = _tiny_weaver_build()
    steps = []
    real, cpu_step = weaver.step, CpuWeaver.step  # (the native CPU path steps through CpuWeaver)
    monkeypatch.setattr(weaver, "step", lambda *a, **k: steps.append(1) or real(*a, **k))
    monkeypatch.setattr(CpuWeaver, "step", lambda *a, **k: steps.append(1) or cpu_step(*a, **k))
    for policy, budget, rounds in ((TreePolicy(), 16, 1), (TreePolicy(), 5, 0), (TreePolicy(spine_rounds=4), 16, 4)):
        steps.clear()
        build(policy, budget)
        assert len(steps) == 1 + rounds, (policy, budget, steps)


def test_the_pool_follows_the_device(monkeypatch):
    """TreePolicy.pool_size None: the Weaver's whole pool on CUDA, 32 candidates per depth elsewhere, never more than
    the Weaver's own; a CPU build scores that many per depth, and a size below 1 is refused."""
    import pytest

    import weaver_kernels
    from modeling_weaver.options import TreePolicy

    assert TreePolicy().pool_on("cpu", 512) == 32 and TreePolicy().pool_on(torch.device("cuda", 0), 512) == 512
    assert TreePolicy().pool_on("cpu", 16) == 16 and TreePolicy(pool_size=64).pool_on("cuda", 512) == 64
    assert TreePolicy(pool_size=1024).pool_on("cpu", 512) == 512
    with pytest.raises(ValueError, match="pool_size"):
        TreePolicy(pool_size=0).pool_on("cpu", 512)
    from weaver_kernels.weaver_tree import cpu as native

    weaver, build = _tiny_weaver_build()
    widths = []
    real, real_spine = weaver_kernels.pool_scores, native.spine_tree  # (the native CPU build scores in spine_tree)
    monkeypatch.setattr(weaver_kernels, "pool_scores", lambda q, r, ids, *a: widths.append(ids.shape[1]) or
                        real(q, r, ids, *a))
    monkeypatch.setattr(native, "spine_tree", lambda q, root, ids, *a: widths.append(ids.shape[1]) or
                        real_spine(q, root, ids, *a))
    for policy, width in ((TreePolicy(), min(32, weaver.config.candidate_pool_size)), (TreePolicy(pool_size=5), 5)):
        widths.clear()
        _, parents, _ = build(policy, 8)
        assert set(widths) == {width} and (parents >= -1).all(), (policy, widths)

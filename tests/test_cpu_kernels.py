"""The native CPU kernels of the Weaver tree build (``weaver_kernels.weaver_tree.cpu``) against their torch
references: each stage alone (fp32 within float rounding, bf16 within one bf16 rounding), the whole build against the
general loop on the references, the encode-in-the-first-step against ``WeaverModel``, their input checks, and the
fallback where no compiler builds them."""

import warnings

import pytest
import torch
from torch.nn import functional as F

from modeling_weaver import tree as tree_module
from modeling_weaver.modeling_weaver import WeaverRMSNorm
from modeling_weaver.options import TreePolicy
from weaver_kernels.weaver_tree import cpu as native
from weaver_kernels.weaver_tree import naive

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: the native CPU kernels are not built")

BF16_STEP = 2.0 ** -7  # one bf16 rounding, relative


def _close(got, want, dtype):
    got, want = got.float(), want.float()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # each side rounded once to bf16 from fp32 values that agree to float precision
        assert ((got - want).abs() <= BF16_STEP * want.abs().clamp(min=1e-3) + 1e-6).all(), (got - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [40, 72])
def test_node_attention_matches_the_reference(dtype, D):
    """RoPE, the slot writes and the attention over the prompt and the masked slots; head dims that are no multiple
    of 16 (the kernels' 16- and 64-wide loops and their tails); slots the mask hides hold NaN and change nothing;
    without outputs only the slots are written."""
    gen = torch.Generator().manual_seed(0)
    H, P, n, M, lo = 3, 5, 9, 4, 2
    qkv = torch.randn(M, 3 * H * D, generator=gen).to(dtype)
    positions = torch.tensor([3, 4, 4, 70])  # (70: past the kernel's table of cos/sin)
    prompt_k, prompt_v = (torch.randn(H, P, D, generator=gen).to(dtype) for _ in range(2))
    mask = torch.rand(M, n, generator=gen) > 0.5
    mask[:, lo + M:] = False
    mask[torch.arange(M), lo + torch.arange(M)] = True
    slots = [torch.randn(H, n, D, generator=gen).to(dtype) for _ in range(2)]
    ref_k, ref_v, nat_k, nat_v = (s.clone() for s in slots + slots)
    for s in (nat_k, nat_v):
        s[:, lo + M:] = float("nan")  # never visible (the reference's softmax would carry the NaN: zeros there)
    want = naive.node_attention_ref(qkv, positions, prompt_k, prompt_v, ref_k, ref_v, mask, lo, 10000.0, 0.3)
    got = native.node_attention(qkv, positions, prompt_k, prompt_v, nat_k, nat_v, mask, lo, 10000.0, 0.3)
    assert not got.isnan().any()
    _close(got, want, dtype)
    _close(nat_k[:, : lo + M], ref_k[:, : lo + M], dtype)
    assert torch.equal(nat_v[:, : lo + M], ref_v[:, : lo + M])
    only = [s.clone() for s in slots]
    assert native.node_attention(qkv, positions, prompt_k, prompt_v, *only, mask, lo, 10000.0, 0.3,
                                 want_output=False) is None
    assert torch.equal(only[1][:, : lo + M], nat_v[:, : lo + M]) and torch.equal(only[0][:, :lo], slots[0][:, :lo])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_activation_match_the_modules(dtype):
    gen = torch.Generator().manual_seed(1)
    norm = WeaverRMSNorm(37).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(37, generator=gen))
        norm.bias.copy_(torch.randn(37, generator=gen))
    x, add = (torch.randn(5, 37, generator=gen).to(dtype) for _ in range(2))
    _close(native.rms_norm_bias(x, norm.weight, norm.bias, norm.eps), norm(x), dtype)
    summed, normed = native.rms_norm_bias(x, norm.weight, norm.bias, norm.eps, add=add)
    assert torch.equal(summed, x + add)
    _close(normed, norm(x + add), dtype)
    gate_up = torch.randn(3, 2 * 21, generator=gen).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    _close(native.silu_mul(gate_up), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_pool_scores_match_the_reference(weight_dtype):
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(300, 24, generator=gen).to(weight_dtype)
    query = torch.randn(4, 24, generator=gen).bfloat16()
    rows = torch.tensor([0, 2, 2, 1])
    ids, logits = torch.randint(0, 300, (3, 11), generator=gen), torch.randn(3, 11, generator=gen)
    want = naive.pool_scores_ref(query, rows, ids, logits, weight)
    _close(native.pool_scores(query, rows, ids, logits, weight), want, torch.float32)
    ids[2, 4] = 300  # (past the weight's rows: refused, not read)
    with pytest.raises(IndexError, match="pool id"):
        native.pool_scores(query, rows, ids, logits, weight)


def _expand_case(seed, spine, ties):
    """Buffers of a build after its spine setup and scores for the nodes 0..spine (``ties``: many equal scores)."""
    gen = torch.Generator().manual_seed(seed)
    n, fan, C, depth = 9, 3, 7, 4
    pool_ids = torch.randint(0, 1000, (depth, C), generator=gen)
    buffers = tree_module._build_buffers(torch.tensor(5), pool_ids, spine, n, fan, "cpu")
    cand = torch.randn(1 + spine, C, generator=gen)
    if ties:
        cand = cand.round()
    return cand, pool_ids, buffers, depth


@pytest.mark.parametrize("spine,ties", [(0, False), (3, False), (3, True), (0, True)])
def test_expand_and_the_pick_match_the_references(spine, ties):
    """One round (publish, then take the best entries; with a spine the chain's log-probs too), the root's leaves and
    the best-known pick: equal to the references, ties broken the same way (lowest index first)."""
    cand, pool_ids, buffers, depth = _expand_case(3 + spine, spine, ties)
    hi = 1 + spine
    ref, nat = [b.clone() for b in buffers], [b.clone() for b in buffers]
    naive.weaver_expand_ref(cand, pool_ids, *ref, 0, hi, 2, depth, spine)
    native.weaver_expand(cand, pool_ids, *nat, 0, hi, 2, depth, spine)
    for r, g in zip(ref, nat):
        assert torch.equal(g, r) if not g.is_floating_point() else torch.allclose(g, r, atol=1e-6), (r, g)
    want_leaves = tree_module._root_leaves(cand[0], pool_ids[0], 3, 6)
    got_leaves = native.root_leaves(cand[0], pool_ids[0], 3, 6)
    assert torch.equal(got_leaves[1], want_leaves[1]) and torch.allclose(got_leaves[0], want_leaves[0], atol=1e-6)
    assert native.root_leaves(cand[0], pool_ids[0], 3, 3) is None
    assert tree_module._root_leaves(cand[0], pool_ids[0], 3, 3) is None
    unmasked = [b for i, b in enumerate(ref) if i != 5], [b for i, b in enumerate(nat) if i != 5]  # (no mask read)
    for budget in (4, 7, 40):  # (40: more than every node and entry: padding)
        want = tree_module.best_known(*unmasked[0], budget, want_leaves)
        got = native.best_known(*unmasked[1], budget, got_leaves)
        if not ties:
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (budget, got, want)
            assert torch.allclose(got[2], want[2], atol=1e-6)
        # (torch's topk orders equal keys as it likes, the kernel lowest index first: the same scores, and the same
        # paths but where equal scores meet the cut)
        got_paths, want_paths = _paths(*got), _paths(*want)
        assert sorted(v for _, v in got_paths) == sorted(v for _, v in want_paths), (budget, got, want)
        cut = min((v for _, v in want_paths), default=0.0)
        assert {p for p in got_paths if p[1] > cut} == {p for p in want_paths if p[1] > cut}, (budget, got, want)


def _paths(tokens, parents, logq):
    """The root paths (token tuples) of a builder's drafts with their rounded log-probs, as a set."""
    out = set()
    for i in range(tokens.shape[0]):
        if parents[i] < 0:
            continue
        path, j = [], i + 1
        while j > 0:
            path.append(int(tokens[j - 1]))
            j = int(parents[j - 1])
        out.add((tuple(path[::-1]), round(float(logq[i]), 4)))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_topk_is_a_stable_sorts_first_k(dtype):
    """The pool's top-k: a stable descending sort's first k (ties — common in bf16 — to the lowest index, NaN first),
    on strided rows, k from 1 to the whole row."""
    gen = torch.Generator().manual_seed(3)
    wide = (torch.randn(4, 300, generator=gen) * 3).to(dtype)
    wide[1, ::7] = wide[1, 5]  # many equal values, some at the boundary
    wide[2, 40], wide[2, 200] = float("nan"), float("nan")
    wide[3] = 0.0
    logits = wide[:, :257]  # rows of stride 300
    order = logits.float().sort(dim=-1, descending=True, stable=True)
    for k in (1, 32, 64, 257):
        values, ids = native.pool_topk(logits, k)
        assert values.dtype == torch.float32 and torch.equal(ids, order.indices[:, :k]), k
        assert torch.equal(values.nan_to_num(), order.values[:, :k].nan_to_num())
    if dtype == torch.float32:  # (no ties in row 0: torch.topk's own answer)
        assert torch.equal(native.pool_topk(logits[:1], 32)[1][0], logits[0].topk(32).indices)
    with pytest.raises(ValueError):
        native.pool_topk(logits, 258)


def test_logits_the_native_top_k_cannot_read_go_to_torch():
    """fp16 or non-contiguous drafter logits on a CPU: the pool comes from ``torch.topk`` (the native pass reads
    contiguous fp32 and bf16 rows), the same tree as from the same values in contiguous fp32."""
    _, build = _tiny()
    logits = build.logits
    for variant in (logits.half(), logits.t().contiguous().t()):
        same = variant.float().contiguous()
        for budget in (5, 12):
            got, want = build(TreePolicy(), budget, variant), build(TreePolicy(), budget, same)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (variant.dtype, budget)


def test_spine_buffers_match_the_torch_setup():
    pool_ids = torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(4))
    for spine in (1, 4):
        want = tree_module._build_buffers(torch.tensor(9), pool_ids, spine, 8, 3, "cpu")
        got = native.spine_buffers(9, pool_ids, spine, 8, 3)
        for w, g in zip(want, got):
            assert torch.equal(g, w), (w, g)


def _tiny():
    from test_tree import _tiny_weaver_build

    return _tiny_weaver_build()


def test_the_native_build_equals_the_general_loop_on_the_references(monkeypatch):
    """The CPU default (a spine, no rounds: one node step and ``spine_tree``) and a build with rounds (the loop over
    the native ops) give the trees the torch references give (fp32: same tokens and parents, log-probs within float
    rounding)."""
    weaver, build = _tiny()
    for policy, budget in ((TreePolicy(), 5), (TreePolicy(), 12), (TreePolicy(spine_rounds=2), 9)):
        got = build(policy, budget)
        with monkeypatch.context() as m:
            m.setattr(native, "available", lambda: False)  # (the ops, the policy and the builder see it)
            assert tree_module.cpu_weaver(weaver, "cpu", policy) is None
            want = build(policy, budget)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (policy, budget, got, want)
        assert torch.allclose(got[2], want[2], atol=1e-5)


def test_spine_tree_reads_a_gathered_copy_of_the_pool_rows():
    """A target split over devices hands the build only its pool's lm_head rows (``pool_rows`` index that copy): the
    same tree as from the whole weight with ``pool_ids`` as rows."""
    gen = torch.Generator().manual_seed(6)
    weight, query = torch.randn(500, 16, generator=gen), torch.randn(4, 16, generator=gen)
    pool_ids, logits = torch.randint(0, 500, (4, 9), generator=gen), torch.randn(4, 9, generator=gen)
    whole = native.spine_tree(query, 7, pool_ids, pool_ids, logits, weight, 3, 6, 5)
    rows = torch.arange(pool_ids.numel()).view_as(pool_ids)
    copied = native.spine_tree(query, 7, pool_ids, rows, logits, weight[pool_ids.flatten()].contiguous(), 3, 6, 5)
    for a, b in zip(whole, copied):
        assert torch.equal(a, b)
    assert (whole[1][:3] >= 0).all()


def test_the_first_step_encodes_the_prompt_as_the_weaver_does():
    """``CpuWeaver.first_step`` (prompt rows and node rows through the same GEMMs) against ``encode_prompt`` and
    ``step`` of the Weaver itself."""
    weaver, _ = _tiny()
    gen = torch.Generator().manual_seed(5)
    d_model, M, n = weaver.config.d_model, 3, 5
    inputs = tree_module.PromptInputs(torch.randn(1, d_model, generator=gen), torch.randn(1, 6, d_model, generator=gen))
    x = torch.randn(M, weaver.config.d_rank, generator=gen)
    positions, mask = torch.arange(1, M + 1), torch.ones(M, n, dtype=torch.bool).tril()
    with torch.no_grad():
        want_prompt = weaver.encode_prompt(inputs.target_hidden, inputs.draft_hidden)
        want = weaver.step(want_prompt, weaver.new_node_cache(n), x[None], positions[None] - 1, slice(0, M),
                           mask[None])[0]
        prompt, got = tree_module.cpu_weaver(weaver, "cpu").first_step(inputs, weaver.new_node_cache(n), x,
                                                                        positions, 0, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(prompt.keys + prompt.values, want_prompt.keys + want_prompt.values):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_inputs_the_kernels_cannot_read_are_refused():
    qkv = torch.randn(2, 3 * 2 * 4)
    slots = torch.zeros(2, 4, 4)
    prompt = torch.randn(2, 3, 4)
    args = (torch.tensor([1, 2]), prompt, prompt, slots, slots.clone(), torch.ones(2, 4, dtype=torch.bool), 0,
            10000.0, 0.5)
    with pytest.raises(ValueError, match="node_attention.*not contiguous"):
        native.node_attention(qkv, args[0], prompt.transpose(1, 2).contiguous().transpose(1, 2), *args[2:])
    with pytest.raises(ValueError, match="node_attention.*int64"):
        native.node_attention(qkv, args[0].int(), *args[1:])
    with pytest.raises(ValueError, match="node_attention: qkv"):
        native.node_attention(qkv[:, :-1].contiguous(), *args)
    with pytest.raises(ValueError, match="node_attention: qkv"):
        native.node_attention(qkv, *args[:5], torch.ones(2, 3, dtype=torch.bool), *args[6:])
    with pytest.raises(IndexError, match="pool row"):  # (a pool row past the pool)
        native.pool_scores(torch.ones(1, 4), torch.tensor([3]), torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2),
                           torch.ones(5, 4))
    with pytest.raises(ValueError, match="rms_norm_bias.*fp32 or bf16"):
        native.rms_norm_bias(torch.ones(2, 3, dtype=torch.float16), torch.ones(3), torch.zeros(3), 1e-6)


def test_without_a_compiler_the_references_run(monkeypatch, tmp_path):
    """No compiler: a warning says so once and the build runs its torch references; with one, the library is built
    into the user's cache (``$XDG_CACHE_HOME/weaver_kernels``)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native._library.cache_clear()
    try:
        monkeypatch.setattr(native.shutil, "which", lambda name: None)
        with pytest.warns(RuntimeWarning, match="no C compiler"):
            assert not native.available()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not native.available()  # (warned once)
        weaver, build = _tiny()
        assert tree_module.cpu_weaver(weaver, "cpu") is None and not TreePolicy().node_attention_on("cpu")
        assert build(TreePolicy(), 5)[0].shape == (5,)
        monkeypatch.undo()
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        native._library.cache_clear()
        assert native.available() and list((tmp_path / "weaver_kernels").glob("weaver_cpu_*.so"))
    finally:
        monkeypatch.undo()
        native._library.cache_clear()

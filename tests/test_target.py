"""Tree verification through real transformers targets equals sequential decoding; commits equal sequential caches."""

import pytest
import torch
from tiny_targets import KEY_TEST_TARGETS, SLIDING_TARGETS, TINY_TARGETS, VOCAB
from transformers import GPT2Config, GPT2LMHeadModel

from modeling_weaver.target import (
    HYBRID_GDN,
    HYBRID_KDA,
    AttentionLayerCache,
    GatedDeltaNetLayerCache,
    KimiDeltaAttentionLayerCache,
    LatentAttentionLayerCache,
    TargetAdapter,
    fused_norm,
)
from modeling_weaver.tree import Tree


def random_tree(num_nodes: int, gen: torch.Generator, max_children: int = 3) -> Tree:
    """A random topological tree; children are not grouped by depth (node order mixes depths)."""
    parents, kids = [-1], [0]
    for i in range(1, num_nodes):
        open_nodes = [j for j in range(i) if kids[j] < max_children]
        parents.append(open_nodes[int(torch.randint(len(open_nodes), (1,), generator=gen))])
        kids[parents[-1]] += 1
        kids.append(0)
    tokens = torch.randint(0, VOCAB, (num_nodes,), generator=gen).tolist()
    return Tree.from_lists(tokens, parents)


def sequential(model, ids: torch.Tensor):
    """HF forward over ``ids`` with its own cache: (logits [T, V], cache, hidden_states)."""
    out = model(ids[None], use_cache=True, output_hidden_states=True)
    return out.logits[0], out.past_key_values, out.hidden_states


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("name", list(KEY_TEST_TARGETS))
def test_tree_logits_equal_sequential_along_every_path(name):
    model = KEY_TEST_TARGETS[name]()
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (13,), generator=gen)
    last = model.config.num_hidden_layers - 1
    target = TargetAdapter(model, max_length=128, feature_layer_ids=[0, last])
    target.prefill(prompt, chunk_size=5)
    for num_nodes in (1, 2, 9, 24):
        tree = random_tree(num_nodes, gen)
        out = target.verify(tree)
        for i in range(len(tree)):
            ids = torch.cat([prompt, tree.tokens[tree.path_to(i)]])
            logits, _, hidden = sequential(model, ids)
            assert rel(out.logits[i], logits[-1]) < 1e-4, (name, num_nodes, i)
            assert rel(out.features[i, :32], hidden[1][0, -1]) < 1e-4
            # features are transformers' hidden_states[id + 1], whose last entry is final-normed
            assert rel(out.features[i, 32:], hidden[last + 1][0, -1]) < 1e-4
    assert target.length == len(prompt)  # verify never commits


@pytest.mark.parametrize("name", list(KEY_TEST_TARGETS))
def test_commit_equals_sequential_caches(name):
    """After several verify/commit rounds on random trees, the committed caches equal HF's sequential caches."""
    model = KEY_TEST_TARGETS[name]()
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, VOCAB, (9,), generator=gen)
    target = TargetAdapter(model, max_length=200)
    target.prefill(prompt, chunk_size=4)
    committed, skips = prompt, 0
    for num_nodes in (5, 17, 1, 12):
        tree = random_tree(num_nodes, gen)
        target.verify(tree)
        # any root→node path may be accepted: the last node's, whose path skips tree rows (the K/V rows must move)
        path = tree.path_to(num_nodes - 1)
        skips += path != list(range(len(path)))
        target.commit(path)
        committed = torch.cat([committed, tree.tokens[path]])
        assert target.length == len(committed)
    assert skips

    _, cache, _ = sequential(model, committed)
    n = len(committed)
    saw = set()
    for i, layer in enumerate(target.layer_caches):
        if isinstance(layer, AttentionLayerCache):
            saw.add("kv")
            # a sliding-window layer of transformers keeps its last rows only (we keep all: the window is a mask)
            m = cache.layers[i].keys.shape[2]
            assert m == (min(n, layer.sliding_window - 1) if layer.sliding_window else n)
            assert rel(layer.keys[:, :, n - m:n], cache.layers[i].keys) < 1e-5
            assert rel(layer.values[:, :, n - m:n], cache.layers[i].values) < 1e-5
            before = layer.keys[:, :, :n].clone(), layer.values[:, :, :n].clone()
            target.verify(random_tree(7, gen))  # a tree's K/V go to scratch rows only
            assert torch.equal(layer.keys[:, :, :n], before[0]) and torch.equal(layer.values[:, :, :n], before[1])
        elif isinstance(layer, LatentAttentionLayerCache):
            saw.add("mla")
            # transformers caches the normed latent as keys and the shared rope part as values
            assert cache.layers[i].keys.shape[2] == n
            assert rel(layer.latent[:, :, :n, : layer.rank], cache.layers[i].keys) < 1e-5
            assert rel(layer.latent[:, :, :n, layer.rank :], cache.layers[i].values) < 1e-5
            before = layer.latent[:, :, :n].clone()
            target.verify(random_tree(7, gen))  # a tree's rows go to scratch rows only
            assert torch.equal(layer.latent[:, :, :n], before)
        else:
            assert isinstance(layer, (GatedDeltaNetLayerCache, KimiDeltaAttentionLayerCache))
            saw.add("gdn" if isinstance(layer, GatedDeltaNetLayerCache) else "kda")
            if not hasattr(cache, "get_recurrent_state"):
                pytest.skip("this transformers version's cache has no get_recurrent_state/get_conv_state")
            assert rel(layer.state, cache.get_recurrent_state(i).float()) < 1e-4
            conv = cache.get_conv_state(i)
            assert rel(layer.window, conv[..., -layer.window.shape[-1]:]) < 1e-5
    kind = model.config.model_type
    assert saw == ({"kv", "gdn"} if kind in HYBRID_GDN else {"mla", "kda"} if kind in HYBRID_KDA else {"kv"})


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_tree_attention_masks_built_once_per_step(name, monkeypatch):
    """A verify builds its [N, bound] attention mask once per sliding window (gemma3 mixes windowed and full
    layers), not once per layer, and the layers' outputs equal those of masks built per layer."""
    import weaver_kernels

    model = KEY_TEST_TARGETS[name]()
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, VOCAB, (11,), generator=gen)
    shared, per_layer = TargetAdapter(model, max_length=64), TargetAdapter(model, max_length=64)
    per_layer.attention_masks = lambda *args: {}  # every layer's op builds its own
    for adapter in (shared, per_layer):
        adapter.prefill(prompt)
    calls = []
    build = weaver_kernels.tree_attention_mask
    monkeypatch.setattr(weaver_kernels, "tree_attention_mask", lambda *a, **k: calls.append(1) or build(*a, **k))
    tree = random_tree(9, gen)
    got = shared.verify(tree)
    assert len(calls) == len(shared.attention_windows) < sum(isinstance(c, AttentionLayerCache)
                                                                for c in shared.layer_caches)
    assert (len(shared.attention_windows) == 2) == (name == "gemma3")
    expected = per_layer.verify(tree)
    assert torch.equal(got.logits, expected.logits)


def test_token_step_equals_a_one_node_tree_pass_and_commit():
    """forward_token (the AR step: one-token GDN kernels, state advanced during the pass) gives the logits, GDN
    state, conv window, K/V and length of a one-node verify + commit, step after step; the gated norm runs inside
    the GDN op here (a form the op reproduces), and outside it when it is not; the gates are formed inside the op
    from the raw projections, and by their own ops in one layer."""
    model = TINY_TARGETS["qwen3_5"]()
    prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(4))
    tree_path, token_path = TargetAdapter(model, max_length=64), TargetAdapter(model, max_length=64)
    gdn = [c for c in token_path.layer_caches if isinstance(c, GatedDeltaNetLayerCache)]
    assert gdn and all(c.norm_in_kernel for c in gdn)
    gdn[0].norm_in_kernel = False  # one layer with the norm applied after the op: both forms are covered
    assert len(gdn) >= 2 and all(c.gates_in_kernel for c in gdn)
    gdn[1].gates_in_kernel = False  # and one with the gates formed before the op
    for adapter in (tree_path, token_path):
        adapter.prefill(prompt)
    token = prompt[-1:]
    for step in range(5):
        expected = tree_path.verify(Tree.from_lists([int(token)], [-1]))
        tree_path.commit([0])
        got = token_path.forward_token(token, token_path.length + 1)
        token_path.length += 1
        assert rel(got.logits, expected.logits) < 1e-5, step
        assert int(token_path.length_t) == tree_path.length == token_path.length
        for a, b in zip(tree_path.layer_caches, token_path.layer_caches):
            if isinstance(a, GatedDeltaNetLayerCache):
                # (layers after the first see inputs that differ by rounding: the two paths use other GDN formulas)
                assert rel(a.state, b.state) < 1e-5 and rel(a.window, b.window) < 1e-6
                assert b.pending is None
            else:
                n = tree_path.length
                assert rel(a.keys[:, :, :n], b.keys[:, :, :n]) < 1e-6
                assert rel(a.values[:, :, :n], b.values[:, :, :n]) < 1e-6
        token = expected.logits.argmax(-1)
    with pytest.raises(ValueError, match="one-node"):
        token_path.forward_tree(torch.tensor([1, 2]), torch.tensor([-1, 0]), 64, advance=True)


def test_kimi_token_step_equals_a_one_node_tree_pass_and_commit():
    """Kimi Linear's AR step (conv_decode + kda_decode in the KDA layers, the MLA row written in place) gives the
    logits, KDA state, conv window, latent rows and length of a one-node verify + commit, and transformers' logits."""
    model = KEY_TEST_TARGETS["kimi_linear"]()
    prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(4))
    tree_path, token_path = TargetAdapter(model, max_length=64), TargetAdapter(model, max_length=64)
    kinds = {type(c) for c in token_path.layer_caches}
    assert kinds == {KimiDeltaAttentionLayerCache, LatentAttentionLayerCache}
    for adapter in (tree_path, token_path):
        adapter.prefill(prompt)
    ids, token = prompt, prompt[-1:]
    for step in range(4):
        expected = tree_path.verify(Tree.from_lists([int(token)], [-1]))
        tree_path.commit([0])
        got = token_path.forward_token(token, token_path.length + 1)
        token_path.length += 1
        ids = torch.cat([ids, token])
        assert rel(got.logits, expected.logits) < 1e-5, step
        assert rel(got.logits[0], model(ids[None]).logits[0, -1]) < 1e-4, step
        n = tree_path.length
        assert int(token_path.length_t) == n == token_path.length
        for a, b in zip(tree_path.layer_caches, token_path.layer_caches):
            if isinstance(a, KimiDeltaAttentionLayerCache):
                assert rel(a.state, b.state) < 1e-5 and rel(a.window, b.window) < 1e-6 and b.pending is None
            else:
                assert rel(a.latent[:, :, :n], b.latent[:, :, :n]) < 1e-6
        token = expected.logits.argmax(-1)


def test_latent_attention_with_low_rank_queries():
    """MLA with ``q_lora_rank`` (queries through q_a_proj, its norm and q_b_proj; the tiny Kimi Linear has full-rank
    queries, as Kimi-Linear-48B): tree logits equal transformers' on every root→node path, and commit compacts the
    latent rows of a path that skips tree rows."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(0)
    config = KimiLinearConfig(**{**KEY_TEST_TARGETS["kimi_linear"]().config.to_dict(), "q_lora_rank": 8,
                                 "num_hidden_layers": 2, "layer_types": ["full_attention", "linear_attention"],
                                 "mlp_layer_types": ["dense", "dense"]})
    model = KimiLinearForCausalLM(config).eval()
    assert model.model.layers[0].self_attn.q_proj is None
    gen = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, VOCAB, (7,), generator=gen)
    target = TargetAdapter(model, max_length=64)
    target.prefill(prompt, chunk_size=3)
    tree = random_tree(9, gen)
    out = target.verify(tree)
    for i in range(len(tree)):
        ids = torch.cat([prompt, tree.tokens[tree.path_to(i)]])
        assert rel(out.logits[i], model(ids[None]).logits[0, -1]) < 1e-4, i
    path = tree.path_to(8)
    assert path != list(range(len(path)))
    target.commit(path)
    _, cache, _ = sequential(model, torch.cat([prompt, tree.tokens[path]]))
    latent, n = target.layer_caches[0].latent, target.length
    assert rel(latent[:, :, :n, :16], cache.layers[0].keys) < 1e-5
    assert rel(latent[:, :, :n, 16:], cache.layers[0].values) < 1e-5


def test_kda_commit_state_from_verification_only(monkeypatch):
    """A KDA layer's verify writes neither state nor window; its commit advances both from the verify's
    intermediates without running a target module."""
    model = KEY_TEST_TARGETS["kimi_linear"]()
    target = TargetAdapter(model, max_length=64)
    target.prefill(torch.arange(7))
    kda = [c for c in target.layer_caches if isinstance(c, KimiDeltaAttentionLayerCache)][0]
    before = (kda.state.clone(), kda.window.clone())
    target.verify(Tree.from_lists([1, 2, 3, 4, 5], [-1, 0, 0, 1, 3]))
    assert torch.equal(kda.state, before[0]) and torch.equal(kda.window, before[1])

    def forbidden(*args, **kwargs):
        raise AssertionError("commit ran a target module")

    for module in model.modules():
        monkeypatch.setattr(module, "forward", forbidden)
    target.commit([0, 1, 3, 4])
    assert not torch.equal(kda.state, before[0]) and not torch.equal(kda.window, before[1])


def test_hybrid_commit_state_from_verification_only(monkeypatch):
    """Commit must use the verification intermediates: the target is never re-run and verify writes no state."""
    model = TINY_TARGETS["qwen3_5"]()
    target = TargetAdapter(model, max_length=64)
    target.prefill(torch.arange(7))
    gdn = [c for c in target.layer_caches if isinstance(c, GatedDeltaNetLayerCache)][0]
    before = (gdn.state.clone(), gdn.window.clone())
    tree = Tree.from_lists([1, 2, 3, 4, 5], [-1, 0, 0, 1, 3])
    target.verify(tree)
    assert torch.equal(gdn.state, before[0]) and torch.equal(gdn.window, before[1])

    def forbidden(*args, **kwargs):
        raise AssertionError("commit ran a target module")

    for module in model.modules():
        monkeypatch.setattr(module, "forward", forbidden)
    target.commit([0, 1, 3, 4])
    assert not torch.equal(gdn.state, before[0])


def test_prefill_matches_hf_forward():
    for name, make in KEY_TEST_TARGETS.items():
        model = make()
        prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3))
        out = TargetAdapter(model, max_length=64).prefill(prompt, chunk_size=16)
        assert rel(out.logits, model(prompt[None]).logits[0]) < 1e-4, name


def test_prefill_keeps_no_verify_intermediates():
    """After a prefill no Gated DeltaNet layer holds its last chunk's verify intermediates (captured steps replay
    without running Python, so they would otherwise stay alive through the whole generation), and the next tree
    still verifies and commits."""
    model = TINY_TARGETS["qwen3_5"]()
    target = TargetAdapter(model, max_length=64)
    target.prefill(torch.arange(5, 30), chunk_size=8)
    gdn = [c for c in target.layer_caches if isinstance(c, GatedDeltaNetLayerCache)]
    assert gdn and all(c.pending is None for c in gdn)
    out = target.verify(Tree.from_lists([3, 4], [-1, 0]))
    target.commit([0, 1])
    ref = model(torch.cat([torch.arange(5, 30), torch.tensor([3, 4])])[None]).logits[0, -1]
    assert rel(out.logits[1], ref) < 1e-4


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_multimodal_wrapper_text_model(name):
    """Qwen3_5(Moe)ForConditionalGeneration: trees run through its language model and lm_head."""
    import transformers

    prefix = {"qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe"}[name]
    text = KEY_TEST_TARGETS[name]().config.to_dict()
    config = getattr(transformers, f"{prefix}Config")(
        text_config=text,
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32),
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config).eval()
    prompt = torch.arange(5, 12)
    target = TargetAdapter(model, max_length=64)
    target.prefill(prompt)
    tree = Tree.from_lists([3, 4, 6], [-1, 0, 0])
    out = target.verify(tree)
    ref = model(torch.cat([prompt, torch.tensor([3, 6])])[None]).logits[0, -1]
    assert rel(out.logits[2], ref) < 1e-4


def test_qwen3_next_fused_projections_split_as_the_model_splits_them():
    """Qwen3-Next's in_proj_qkvz / in_proj_ba are laid out per key head: the GDN inputs gathered from them equal the
    model's own fix_query_key_value_ordering (q, k, v flat into the conv input; z, b, a per value head)."""
    model = TINY_TARGETS["qwen3_next"]()
    target = TargetAdapter(model, max_length=16)
    h = torch.randn(1, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    caches = [c for c in target.layer_caches if isinstance(c, GatedDeltaNetLayerCache)]
    assert len(caches) >= 2 and all(c.per_key_head for c in caches)
    for cache in caches:
        gdn = cache.gdn
        assert gdn.num_v_heads > gdn.num_k_heads and gdn.head_k_dim != gdn.head_v_dim  # (a mix-up shows)
        q, k, v, z, b, a = gdn.fix_query_key_value_ordering(gdn.in_proj_qkvz(h), gdn.in_proj_ba(h))
        mixed, z2, b2, a2 = cache._inputs(h)
        expected = torch.cat([t.reshape(1, 5, -1) for t in (q, k, v)], dim=-1)
        for got, want in ((mixed, expected), (z2, z), (b2, b), (a2, a)):
            assert got.shape == want.shape and rel(got, want) < 1e-6


@pytest.mark.parametrize("name", list(SLIDING_TARGETS))
def test_the_window_cuts(name):
    """The sliding targets' windows are shorter than the prompts: transformers' greedy output differs from the same
    weights with full attention (else the sliding tests could not fail), and the adapter's layers carry the window."""
    from test_generate import prompts, reference

    from tiny_targets import WINDOW

    model, full = SLIDING_TARGETS[name](), SLIDING_TARGETS[name](sliding_window=None)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), full.state_dict().values()))
    ids = prompts()[2]
    assert ids.shape[1] > WINDOW
    assert not torch.equal(reference(model, ids, 16), reference(full, ids, 16))
    windows = [c.sliding_window for c in TargetAdapter(model, max_length=64).layer_caches]
    assert windows == ([WINDOW] * 3 if name == "mistral" else [WINDOW, 0, WINDOW])
    assert [c.sliding_window for c in TargetAdapter(full, max_length=64).layer_caches] == [0, 0, 0]


def test_unsupported_architecture_is_refused():
    from transformers import Gemma3TextConfig, MixtralConfig, MixtralForCausalLM

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported targets: LlamaForCausalLM"):
        TargetAdapter(model, max_length=16)
    mixtral = MixtralForCausalLM(MixtralConfig(vocab_size=50, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1, num_local_experts=2))
    with pytest.raises(ValueError,
                       match="MixtralForCausalLM.*supported targets: .*GptOssForCausalLM.*KimiLinearForCausalLM"):
        TargetAdapter(mixtral, max_length=16)
    bidirectional = SLIDING_TARGETS["gemma3"]().config.to_dict()
    config = Gemma3TextConfig(**{**bidirectional, "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="Gemma3ForCausalLM with bidirectional attention"):
        TargetAdapter(type(SLIDING_TARGETS["gemma3"]())(config), max_length=16)


def test_capacity_and_commit_order_errors():
    target = TargetAdapter(TINY_TARGETS["llama"](), max_length=8)
    with pytest.raises(RuntimeError, match="must follow verify"):
        target.commit([0])
    target.prefill(torch.arange(6))
    with pytest.raises(ValueError, match="capacity"):
        target.verify(Tree.from_lists([1, 2, 3], [-1, 0, 1]))
    with pytest.raises(ValueError, match="outside the target"):
        TargetAdapter(TINY_TARGETS["llama"](), max_length=8, feature_layer_ids=[7])


@pytest.mark.parametrize("name", list(KEY_TEST_TARGETS))
def test_padded_tree_over_the_whole_cache_equals_the_plain_verify(name):
    """A captured step's shapes (tree padded with extra roots, attention over all ``max_length`` rows, commit of a
    -1-padded path) give the plain verify's logits on the real nodes and the same committed caches."""
    model = KEY_TEST_TARGETS[name]()
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, VOCAB, (6,), generator=gen)
    plain, static = TargetAdapter(model, max_length=80), TargetAdapter(model, max_length=80)
    plain.prefill(prompt)
    static.prefill(prompt)
    for num_nodes in (9, 3, 14):
        tree = random_tree(num_nodes, gen)
        a = plain.verify(tree)
        b = static.verify(tree.padded(16), bound=static.max_length)
        assert rel(b.logits[:num_nodes], a.logits) < 1e-5 and rel(b.hidden[:num_nodes], a.hidden) < 1e-5
        path = tree.path_to(int(torch.randint(num_nodes, (1,), generator=gen)))
        plain.commit(path)
        static.commit(torch.tensor(path + [-1] * (16 - len(path))), num_accepted=len(path))
        assert static.length == plain.length == int(static.length_t)
    n = plain.length
    # (a MoE block's experts see the padding nodes too: other GEMM sizes, other rounding, carried to later layers)
    tol = 1e-5 if any("experts" in dict(layer.mlp.named_children()) for layer in model.model.layers) else 1e-6
    for p_cache, s_cache in zip(plain.layer_caches, static.layer_caches):
        if isinstance(p_cache, AttentionLayerCache):
            assert rel(s_cache.keys[:, :, :n], p_cache.keys[:, :, :n]) < tol
            assert rel(s_cache.values[:, :, :n], p_cache.values[:, :, :n]) < tol
        elif isinstance(p_cache, LatentAttentionLayerCache):
            assert rel(s_cache.latent[:, :, :n], p_cache.latent[:, :, :n]) < tol
        else:
            assert rel(s_cache.state, p_cache.state) < tol and rel(s_cache.window, p_cache.window) < tol


def test_ancestor_mask_and_depths_match_a_parent_walk():
    gen = torch.Generator().manual_seed(0)
    for num_nodes in (1, 2, 5, 33, 129):
        tree = random_tree(num_nodes, gen)
        parents = tree.parents.tolist()
        for i in range(num_nodes):
            path = tree.path_to(i)
            assert tree.ancestor_mask[i].nonzero().flatten().tolist() == sorted(path)
            assert int(tree.depths[i]) == len(path) - 1
            assert parents[i] < i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(KEY_TEST_TARGETS))
def test_every_target_norm_runs_as_one_fused_op(name, dtype):
    """Each RMSNorm of the tiny targets (layer norms, q/k norms, GDN output norms, final norm) is recognised and
    taken over by weaver_kernels.rms_norm, whose result equals the module's bit for bit here (torch reference)."""
    model = KEY_TEST_TARGETS[name]().to(dtype)
    norms = [m for m in model.modules() if type(m).__name__.endswith(("RMSNorm", "RMSNormGated"))]
    assert norms
    for module in norms:
        fused = fused_norm(module, dtype)
        assert fused is not module, type(module).__name__
        x = 4 * torch.randn(2, 3, module.weight.shape[0], dtype=dtype)
        gated = type(module).__name__.endswith("Gated")
        gate = torch.randn_like(x) if gated else None
        assert torch.equal(fused(x, gate) if gated else fused(x), module(x, gate) if gated else module(x))


def test_unknown_norm_keeps_the_module():
    class OddNorm(torch.nn.Module):  # a name the op does not know
        def __init__(self):
            super().__init__()
            self.weight, self.eps = torch.nn.Parameter(torch.ones(4)), 1e-6

        def forward(self, x):
            return x * 2

    module = OddNorm()
    assert fused_norm(module, torch.float32) is module
    liar = TINY_TARGETS["llama"]().model.norm
    liar.forward = lambda x: x  # the right name, another computation: the self-check refuses it
    assert fused_norm(liar, torch.float32) is liar
    norm = TINY_TARGETS["llama"]().model.norm  # fp32 weight with bf16 activations would promote: keep the module
    assert fused_norm(norm, torch.bfloat16) is norm


def _shared_groups(model):
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate_proj"):  # (a MoE block's experts run as the model runs them)
            yield [layer.mlp.gate_proj, layer.mlp.up_proj]
        attn = getattr(layer, "self_attn", None)
        if hasattr(attn, "forget_gate"):  # Kimi Linear: KDA
            yield [attn.q_proj, attn.k_proj, attn.v_proj, attn.forget_gate.f_a_proj, attn.b_proj, attn.g_a_proj]
        elif hasattr(attn, "kv_a_proj_with_mqa"):  # and MLA
            yield [attn.q_proj, attn.kv_a_proj_with_mqa]
        elif hasattr(layer, "linear_attn"):
            g = layer.linear_attn
            yield [g.in_proj_qkvz, g.in_proj_ba] if hasattr(g, "in_proj_qkvz") else [
                g.in_proj_qkv, g.in_proj_z, g.in_proj_b, g.in_proj_a]
        else:
            yield [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]


@pytest.mark.parametrize("name", list(KEY_TEST_TARGETS))
def test_shared_input_projections_become_one_tensor_with_the_same_values(name, tmp_path):
    from transformers import AutoModelForCausalLM

    model = KEY_TEST_TARGETS[name]()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {k: id(p) for k, p in model.named_parameters()}
    TargetAdapter(model, max_length=64)
    for group in _shared_groups(model):  # row blocks of one storage, in order
        ptr, size = group[0].weight.data_ptr(), group[0].weight.element_size()
        assert len({m.weight.untyped_storage().data_ptr() for m in group}) == 1
        assert [m.weight.data_ptr() for m in group] == [
            ptr + size * sum(n.weight.numel() for n in group[:i]) for i in range(len(group))]
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert params == {k: id(p) for k, p in model.named_parameters()}  # same Parameter objects
    ptrs = [p.data_ptr() for p in model.parameters()]
    TargetAdapter(model, max_length=64)  # already merged: nothing moves
    assert ptrs == [p.data_ptr() for p in model.parameters()]
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    assert set(reloaded) >= set(before) and all(torch.equal(before[k], reloaded[k]) for k in before)


def test_shared_input_linears_equal_the_modules_and_refuse_what_cannot_merge():
    from modeling_weaver.target import SharedInputLinears

    torch.manual_seed(0)
    x = torch.randn(3, 5, 16)
    for bias in (False, True):
        linears = [torch.nn.Linear(16, n, bias=bias) for n in (7, 2, 9)]
        expected = [m(x) for m in linears]
        merged = SharedInputLinears(*linears)
        assert merged.weight is not None and (merged.bias is not None) == bias
        for got, want in zip(merged(x), expected):
            torch.testing.assert_close(got, want)
    mixed = [torch.nn.Linear(16, 4, bias=True), torch.nn.Linear(16, 4, bias=False)]
    hooked = [torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)]
    calls = []
    hooked[1].register_forward_hook(lambda *a: calls.append(1))
    for linears in (mixed, hooked, [torch.nn.Linear(16, 4), torch.nn.Linear(8, 4)]):
        ptrs = [m.weight.data_ptr() for m in linears]
        shared = SharedInputLinears(*linears)
        assert shared.weight is None and ptrs == [m.weight.data_ptr() for m in linears]
        if linears[0].in_features == linears[1].in_features:
            outs = shared(x)
            assert all(torch.equal(o, m(x)) for o, m in zip(outs, linears))
    assert calls  # the hook ran: the module was called
    patched = [torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)]
    patched[0].forward = lambda x: x  # (as accelerate's hooks do)
    assert SharedInputLinears(*patched).weight is None
    from torch.testing._internal.two_tensor import TwoTensor

    sub = [torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)]
    with torch.no_grad():
        sub[0].weight = torch.nn.Parameter(TwoTensor(sub[0].weight.clone(), sub[0].weight.clone()))
    assert SharedInputLinears(*sub).weight is None  # tensor-subclass weights (quantized, DTensor) stay as they are


def test_row_blocks_are_only_found_where_they_are():
    from modeling_weaver.target import _row_blocks_of_one, merge_rows

    base = torch.arange(40.0)
    assert _row_blocks_of_one([base[:8].view(2, 4), base[8:24].view(4, 4)]) is not None
    assert torch.equal(_row_blocks_of_one([base[:8].view(2, 4), base[8:24].view(4, 4)]), base[:24].view(6, 4))
    assert _row_blocks_of_one([base[:8].view(2, 4), base[8:16].view(4, 2)]) is None  # other row width
    assert _row_blocks_of_one([base[:8].view(2, 4), base[12:20].view(2, 4)]) is None  # a gap
    assert _row_blocks_of_one([base[:8].view(2, 4), torch.arange(8.0).view(2, 4)]) is None  # another storage
    assert _row_blocks_of_one([base[:8].view(2, 4), base[8:8].view(0, 4)]) is None  # empty
    odd = base.as_strided((1, 4), (8, 1))  # one row, any row stride: still contiguous
    merged = _row_blocks_of_one([odd, base[4:8].view(1, 4)])
    assert merged is not None and merged.is_contiguous() and torch.equal(merged, base[:8].view(2, 4))
    # merged under inference_mode, the parameters still train
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(2, 4))]
    with torch.inference_mode():
        merge_rows(params)
    (params[0].sum() + params[1].sum()).backward()
    assert params[0].grad is not None and not params[0].is_inference()


def test_static_target_follows_reallocated_weights():
    """A cached fixed-shape step reads the weights through pointers (merged projections, graphs): weights loaded
    with ``assign=True`` afterwards (new tensors) must be the ones verified, not the old ones."""
    from test_generate import reference

    from modeling_weaver.lab.benchmark import autoregressive_generate

    model = TINY_TARGETS["qwen3_5"]()
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    assert torch.equal(autoregressive_generate(model, ids, 12, eos_token_id=[], target_step="static"),
                       reference(model, ids, 12))
    # new tensors for the merged projections (large, so that they decide the output)
    gen = torch.Generator().manual_seed(5)
    other = {k: torch.randn(v.shape, generator=gen) if k.endswith("proj.weight") else v
             for k, v in model.state_dict().items()}
    from modeling_weaver.decoding.step_cache import _STATIC_TARGETS

    old_steps = list(_STATIC_TARGETS[model].values())
    model.load_state_dict(other, assign=True)
    expected = reference(model, ids, 12)
    assert not torch.equal(expected, reference(TINY_TARGETS["qwen3_5"](), ids, 12))  # (the weights matter)
    assert torch.equal(autoregressive_generate(model, ids, 12, eos_token_id=[], target_step="static"), expected)
    assert not any(s is t for s in old_steps for t in _STATIC_TARGETS[model].values())  # none of the old kept


def test_static_draft_follows_reallocated_weights():
    """The drafter's cached steps read the target's embedding and lm_head and the drafter's own weights: replaced
    ones give a new StaticDraft (and drop the fused steps built on the target's replaced steps)."""
    from test_generate import make_drafters

    from modeling_weaver.decoding.step_cache import _STATIC_TARGETS, static_draft, static_target
    from modeling_weaver.generate import speculative_generate

    model = TINY_TARGETS["qwen3_5"]()
    drafter, weaver = make_drafters(model)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    kwargs = dict(drafter=drafter, weaver=weaver, mode="weaver", tree_budget=6, max_new_tokens=10, target_step="static")
    speculative_generate(model, ids, **kwargs)
    draft = static_draft(drafter, model, 9 + 10 + 6 + 2, capture=False)
    assert static_draft(drafter, model, 9 + 10 + 6 + 2, capture=False) is draft  # unchanged weights: the same steps
    assert any(k[0] == "fused" for k in draft._steps)
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(torch.randn_like(head.weight))
    new = static_draft(drafter, model, 9 + 10 + 6 + 2, capture=False)
    assert new is not draft and new.head.weight is head.weight
    # a target step replaced (its weights moved) is not kept alive by a fused step built on it
    def held():  # the target steps the drafter's fused steps hold
        return [v.target for d in _STATIC_TARGETS[drafter].values() for v in d._steps.values() if hasattr(v, "target")]

    speculative_generate(model, ids, **kwargs)
    old_target = static_target(model, 9 + 10 + 6 + 2, 7, list(drafter.config.target_layer_ids), capture=False,
                               max_tree_depth=drafter.config.block_size - 1)
    assert any(t is old_target for t in held())
    gdn = model.model.layers[0].linear_attn
    gdn.in_proj_z.weight = torch.nn.Parameter(gdn.in_proj_z.weight.detach().clone())
    speculative_generate(model, ids, **kwargs)
    assert held() and not any(t is old_target for t in held())


def test_fixed_shape_cuda_steps_run_moe_experts_capturably_and_restore_the_setting():
    """Outside bf16, transformers' grouped-GEMM experts read their offsets on the host (not capturable): graph and
    compiled steps on CUDA switch them to ``batched_mm`` for the call only; eager steps, CPU, bf16 and dense models
    keep theirs. With the switch the loop is still token-identical (here on the CPU, static steps)."""
    from test_generate import make_drafters, prompts, reference

    from modeling_weaver import speculative_generate
    from modeling_weaver.target import capturable_experts

    moe, dense = TINY_TARGETS["qwen3_moe"](), TINY_TARGETS["llama"]()
    before = moe.config._experts_implementation
    assert before != "batched_mm"
    with capturable_experts(moe, "cuda", "graph"):
        assert moe.config._experts_implementation == "batched_mm"
        drafter, weaver = make_drafters(moe)
        ids = prompts()[0]
        out = speculative_generate(moe, ids, drafter=drafter, weaver=weaver, mode="weaver", tree_budget=6,
                                   max_new_tokens=24, target_step="static")
    assert moe.config._experts_implementation == before
    assert torch.equal(out, reference(moe, ids, 24))
    for model, device, step in ((moe, "cuda", "eager"), (moe, "cpu", "graph"), (dense, "cuda", "graph"),
                                (moe.to(torch.bfloat16), "cuda", "compiled")):
        own = model.config._experts_implementation
        with capturable_experts(model, device, step):
            assert model.config._experts_implementation == own

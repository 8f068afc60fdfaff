"""The speculative loop is lossless: greedy output equals ``target.generate(do_sample=False)`` token for token."""

import pytest
import torch
from tiny_targets import KEY_TEST_TARGETS, TINY_TARGETS, VOCAB
from transformers import AutoModel

from modeling_weaver import (
    DFlashConfig,
    DFlashDraftModel,
    WeaverConfig,
    WeaverModel,
    generate,
    speculative_generate,
)
from modeling_weaver.decoding.step_cache import _STATIC_TARGETS
from modeling_weaver.generate import MODES, DFlashRunner, _decode
from modeling_weaver.options import StepOptions, TreePolicy
from modeling_weaver.target import text_config
from transformers.generation import EosTokenCriteria, LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList

NEW_TOKENS = 64
BLOCK = 8


def make_drafters(target, seed: int = 0, mask_token_id=None):
    torch.manual_seed(seed)
    dconfig = DFlashConfig.from_target_config(
        target.config, num_hidden_layers=2, block_size=BLOCK, mask_token_id=mask_token_id,
        target_layer_ids=[0, 1],
    )
    drafter = DFlashDraftModel(dconfig).eval()
    wconfig = WeaverConfig.from_target_config(target.config, dconfig, d_rank=32, num_heads=4, mlp_dim=64,
                                              candidate_pool_size=16)
    weaver = WeaverModel(wconfig).eval()
    return drafter, weaver


def prompts(n=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (1, length), generator=gen) for length in (1, 7, 23)[:n]]


def reference(target, ids, max_new_tokens, eos_token_id=None):
    # an explicit mask: without one, transformers masks out every prompt token equal to pad_token_id
    return target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                           eos_token_id=eos_token_id, pad_token_id=0, min_new_tokens=0)


class OracleRunner:
    """A drafter that knows the target's greedy continuation: its marginals put the true token first with
    probability ``agree`` and second otherwise, so long paths are accepted and branches matter."""

    def __init__(self, reference_ids: torch.Tensor, hidden_size: int, block_size: int = BLOCK, agree: float = 0.85,
                 seed: int = 0, vocab: int = VOCAB, device="cpu"):
        self.ref = reference_ids[0].tolist()
        self.hidden_size, self.block_size, self.agree = hidden_size, block_size, agree
        self.vocab, self.device = vocab, device
        self.gen = torch.Generator().manual_seed(seed)
        self.feature_layer_ids = [0, 1]

    def draft(self, bonus, context, n, depths=None):  # (every depth: trees use the first ``depths``)
        assert bonus == self.ref[n], "the loop's bonus token must be the target's own choice"
        depth, vocab = self.block_size - 1, self.vocab
        logits = 0.1 * torch.randn(depth, vocab, generator=self.gen)
        for j in range(depth):
            pos = n + 1 + j
            true = self.ref[pos] if pos < len(self.ref) else int(torch.randint(vocab, (1,), generator=self.gen))
            if float(torch.rand((), generator=self.gen)) < self.agree:
                logits[j, true] += 6.0
            else:
                logits[j, (true + 1 + int(torch.randint(vocab - 1, (1,), generator=self.gen))) % vocab] += 6.0
                logits[j, true] += 4.0
        hidden = torch.randn(depth, self.hidden_size, generator=self.gen)
        return hidden.to(self.device), logits.to(self.device)


def oracle_reference(target, ids, max_new_tokens):
    """The greedy continuation an oracle drafter plants (past the end, for its last block) and, as its prefix of
    ``max_new_tokens``, what ``reference`` gives: greedy decoding without eos does not depend on where it stops."""
    long = reference(target, ids, max_new_tokens + 2 * BLOCK)
    return long, long[:, : ids.shape[1] + max_new_tokens]


def run_oracle(target, weaver, ids, mode, budget, max_new_tokens, eos_token_id=None, seed=0,
               target_step="eager", tree_policy=TreePolicy(), ref=None):
    """``ref``: ``oracle_reference(...)[0]`` when the caller has it (one reference generation fewer)."""
    ref = oracle_reference(target, ids, max_new_tokens)[0] if ref is None else ref
    stopping = StoppingCriteriaList([MaxLengthCriteria(ids.shape[1] + max_new_tokens)])
    if eos_token_id is not None:
        stopping.append(EosTokenCriteria(eos_token_id))
    config = text_config(target.config)
    runner = OracleRunner(ref.cpu(), config.hidden_size, seed=seed, vocab=config.vocab_size, device=ids.device)
    return _decode(
        target, ids[0], runner=runner, weaver=weaver,
        mode=mode, tree_budget=budget, max_new_tokens=max_new_tokens, processors=LogitsProcessorList(),
        do_sample=False, verification="target_only", stopping_criteria=stopping, streamer=None, generator=None,
        target_step=target_step, tree_policy=tree_policy,
    )


@pytest.fixture(scope="module")
def references():
    """``get(key, compute)``: ``compute()`` once per key, so that the modes' cases of one target share its greedy
    references (the tiny targets are seeded: a name gives the same weights)."""
    found = {}

    def get(key, compute):
        if key not in found:
            found[key] = compute()
        return found[key]

    return get


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(KEY_TEST_TARGETS))
def test_greedy_identity_random_drafters(name, mode, references):
    target = KEY_TEST_TARGETS[name]()
    drafter, weaver = make_drafters(target, mask_token_id=None if name == "qwen3_5" else VOCAB - 1)
    for ids in prompts():
        expected = references((name, ids.shape[1], "plain"), lambda: reference(target, ids, NEW_TOKENS))
        got = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget=12,
                                   max_new_tokens=NEW_TOKENS)
        assert torch.equal(got, expected), (name, mode, ids.shape)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(KEY_TEST_TARGETS))
def test_greedy_identity_with_long_accepted_paths(name, mode, references):
    """A drafter that agrees with the target often: deep commits through every cache type stay exact."""
    target = KEY_TEST_TARGETS[name]()
    _, weaver = make_drafters(target)
    with torch.no_grad():  # Weaver adds nothing to the planted marginals: its trees follow them
        weaver.lm_head_query_in.weight.zero_()
    for seed, ids in enumerate(prompts()):
        long, expected = references((name, ids.shape[1], "oracle"), lambda: oracle_reference(target, ids, NEW_TOKENS))
        got, stats = run_oracle(target, weaver, ids, mode, budget=24, max_new_tokens=NEW_TOKENS, seed=seed, ref=long)
        assert torch.equal(got, expected), (name, mode, seed)
        assert stats.num_new_tokens == NEW_TOKENS
        assert max(stats.accepted_lengths) >= 6, stats.accepted_lengths
        assert stats.mean_accepted_length > 2.5, stats.mean_accepted_length
        assert all(size <= 25 for size in stats.tree_sizes)


@pytest.mark.parametrize("name", list(TINY_TARGETS))
def test_greedy_identity_best_first_rounds(name, monkeypatch):
    """Weaver trees from best-first rounds (TreePolicy.spine off; the other loop tests take the default spine
    trees): random drafters, and a drafter that agrees with the target often (deep paths)."""
    policy = TreePolicy(spine=False)
    target = TINY_TARGETS[name]()
    drafter, weaver = make_drafters(target, mask_token_id=None if name == "qwen3_5" else VOCAB - 1)
    for seed, ids in enumerate(prompts()):
        long, expected = oracle_reference(target, ids, NEW_TOKENS)
        got = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode="weaver", tree_budget=12,
                                   max_new_tokens=NEW_TOKENS, tree_policy=policy)
        assert torch.equal(got, expected), (name, ids.shape)
        got, stats = run_oracle(target, weaver, ids, "weaver", budget=24, max_new_tokens=NEW_TOKENS, seed=seed,
                                tree_policy=policy, ref=long)
        assert torch.equal(got, expected), (name, seed)
        assert max(stats.accepted_lengths) >= 6, stats.accepted_lengths


@pytest.mark.parametrize("name", list(TINY_TARGETS))
def test_static_shapes_give_the_same_tokens(name):
    """Padded trees, attention over the whole cache, padded commits (a captured step's shapes): the same tokens as
    the dynamic path and as AR, over many steps, deep accepted paths and several prompt lengths."""
    target = TINY_TARGETS[name]()
    drafter, weaver = make_drafters(target, mask_token_id=None if name == "qwen3_5" else VOCAB - 1)
    gen = torch.Generator().manual_seed(5)
    for mode, length in zip(MODES, (2, 13, 31)):
        ids = torch.randint(0, VOCAB, (1, length), generator=gen)
        long, expected = oracle_reference(target, ids, NEW_TOKENS)
        got, stats = run_oracle(target, weaver, ids, mode, budget=24, max_new_tokens=NEW_TOKENS,
                                target_step="static", ref=long)
        assert torch.equal(got, expected), (name, mode, length)
        assert max(stats.accepted_lengths) >= 6 and len(stats.accepted_lengths) >= 8, stats.accepted_lengths
        random_drafts = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget=12,
                                             max_new_tokens=NEW_TOKENS, target_step="static")
        assert torch.equal(random_drafts, expected), (name, mode, length)
    # one set of static buffers per tree size, reset and reused across prompts of different lengths
    assert sorted(key[1] for key in _STATIC_TARGETS[target]) == [13, 25]


@pytest.mark.parametrize("name", list(TINY_TARGETS))
def test_eos_inside_an_accepted_path(name):
    target = TINY_TARGETS[name]()
    _, weaver = make_drafters(target)
    # an eos that first appears mid-continuation, so it lands inside an accepted path
    for ids in prompts():
        long, plain = oracle_reference(target, ids, 40)
        cont = plain[0, ids.shape[1]:].tolist()
        eos = next((tok for k, tok in enumerate(cont) if k >= 2 and tok not in cont[:k]), None)
        if eos is not None:
            break
    expected = reference(target, ids, 40, eos_token_id=[eos, VOCAB + 5])
    assert expected.shape[1] < ids.shape[1] + 40 and expected[0, -1] == eos
    for mode in MODES:
        got, stats = run_oracle(target, weaver, ids, mode, budget=16, max_new_tokens=40,
                                eos_token_id=[eos, VOCAB + 5], ref=long)
        assert torch.equal(got, expected), mode
        assert stats.num_new_tokens == expected.shape[1] - ids.shape[1]


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_custom_generate_equals_speculative_generate(name):
    target = TINY_TARGETS[name]()
    drafter, weaver = make_drafters(target)
    ids = prompts()[2]
    for mode in MODES:
        direct = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget=10,
                                      max_new_tokens=20)
        via_hf = target.generate(ids, custom_generate=generate, drafter=drafter, weaver=weaver, mode=mode,
                                 tree_budget=10, max_new_tokens=20, do_sample=False)
        assert torch.equal(direct, via_hf)
        assert torch.equal(via_hf, reference(target, ids, 20))
        static = target.generate(ids, custom_generate=generate, drafter=drafter, weaver=weaver, mode=mode,
                                 tree_budget=10, max_new_tokens=20, do_sample=False, target_step="static")
        assert torch.equal(static, via_hf)
    with pytest.raises(ValueError, match="target_step"):  # the option reaches the loop through transformers
        target.generate(ids, custom_generate=generate, drafter=drafter, weaver=weaver, mode="chain", tree_budget=10,
                        max_new_tokens=5, do_sample=False, target_step="bogus")


def test_custom_generate_honours_eos_and_generation_config():
    target = TINY_TARGETS["qwen3"]()
    drafter, weaver = make_drafters(target)
    ids = prompts()[1]
    cont = reference(target, ids, 30)[0, ids.shape[1]:].tolist()
    eos = next(tok for k, tok in enumerate(cont) if k >= 3 and tok not in cont[:k])
    target.generation_config.eos_token_id = [eos]
    target.generation_config.max_new_tokens = 30
    got = target.generate(ids, custom_generate=generate, drafter=drafter, weaver=weaver, do_sample=False)
    assert torch.equal(got, reference(target, ids, 30, eos_token_id=[eos]))
    assert got[0, -1] == eos


def test_streamer_receives_prompt_then_every_token():
    target = TINY_TARGETS["llama"]()
    drafter, weaver = make_drafters(target)

    class Recorder:
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    ids = prompts()[1]
    rec = Recorder()
    out = speculative_generate(target, ids, drafter=drafter, weaver=weaver, max_new_tokens=16, streamer=rec)
    assert rec.chunks[0] == ids[0].tolist() and rec.ended
    assert sum(rec.chunks, []) == out[0].tolist()


def test_stopping_criteria_see_every_emitted_token_on_the_host():
    """Stopping criteria are called once per emitted token — the last one included — with the ids so far on the
    CPU; the output stops at max_new_tokens and is not a view of the loop's buffer."""
    from transformers.generation import StoppingCriteria

    class Lengths(StoppingCriteria):
        def __init__(self):
            self.seen = []

        def __call__(self, input_ids, scores, **kwargs):
            self.seen.append((input_ids.shape[1], input_ids.device.type))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    target = TINY_TARGETS["llama"]()
    drafter, weaver = make_drafters(target)
    ids = prompts()[0]
    lengths = Lengths()
    got, _ = _decode(
        target, ids[0], runner=DFlashRunner(drafter, target), weaver=weaver, mode="ddtree", tree_budget=8,
        max_new_tokens=11, processors=LogitsProcessorList(), do_sample=False, verification=None,
        stopping_criteria=StoppingCriteriaList([lengths]), streamer=None, generator=None,
    )
    assert lengths.seen == [(ids.shape[1] + k, "cpu") for k in range(1, 12)]
    assert torch.equal(got, reference(target, ids, 11)) and got.untyped_storage().nbytes() == got.nbytes


def test_streamer_through_transformers_generate():
    """transformers keeps ``streamer=`` for itself with a callable custom_generate; ``tree_streamer=`` gets it all."""
    target = TINY_TARGETS["llama"]()
    drafter, weaver = make_drafters(target)
    ids = prompts()[1]
    chunks, ended = [], []
    streamer = type("S", (), {"put": lambda self, v: chunks.append(v.reshape(-1).tolist()),
                              "end": lambda self: ended.append(True)})()
    out = target.generate(ids, custom_generate=generate, drafter=drafter, weaver=weaver, max_new_tokens=16,
                          do_sample=False, tree_streamer=streamer)
    assert chunks[0] == ids[0].tolist() and sum(chunks, []) == out[0].tolist() and ended == [True]


def test_return_dict_and_unsupported_outputs():
    target = TINY_TARGETS["llama"]()
    drafter, weaver = make_drafters(target)
    ids = prompts()[1]
    out = target.generate(ids, custom_generate=generate, drafter=drafter, weaver=weaver, max_new_tokens=8,
                          do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference(target, ids, 8))
    with pytest.raises(ValueError, match="output_scores"):
        target.generate(ids, custom_generate=generate, drafter=drafter, weaver=weaver, max_new_tokens=8,
                        do_sample=False, return_dict_in_generate=True, output_scores=True)


def test_generation_config_processors_are_not_silently_dropped():
    """target.generate(do_sample=False) applies a repetition penalty from generation_config; so must we, or refuse."""
    target = TINY_TARGETS["llama"]()
    drafter, weaver = make_drafters(target)
    target.generation_config.repetition_penalty = 1.2
    with pytest.raises(ValueError, match="repetition_penalty"):
        speculative_generate(target, prompts()[1], drafter=drafter, weaver=weaver, max_new_tokens=4)


def test_tree_budget_beyond_the_gdn_kernel_limit_is_refused_upfront(monkeypatch):
    import weaver_kernels

    target = TINY_TARGETS["qwen3_5"]()
    drafter, weaver = make_drafters(target)
    monkeypatch.setattr(weaver_kernels, "max_tree_nodes", lambda device: 8)  # as the Triton kernel's 128 on CUDA
    with pytest.raises(ValueError, match="verifies at most 8 nodes"):
        speculative_generate(target, prompts()[1], drafter=drafter, weaver=weaver, tree_budget=8, max_new_tokens=4)
    out = speculative_generate(target, prompts()[1], drafter=drafter, weaver=weaver, tree_budget=7, max_new_tokens=4)
    assert torch.equal(out, reference(target, prompts()[1], 4))


def test_sampling_runs_and_is_reproducible():
    target = TINY_TARGETS["qwen3_5"]()
    drafter, weaver = make_drafters(target)
    ids = prompts()[1]
    for mode in MODES:
        outs = [
            speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, max_new_tokens=12,
                                 do_sample=True, temperature=0.8, top_k=20, top_p=0.9,
                                 generator=torch.Generator().manual_seed(5))
            for _ in range(2)
        ]
        assert torch.equal(outs[0], outs[1]) and outs[0].shape[1] == ids.shape[1] + 12


def test_save_load_round_trip_gives_same_tokens(tmp_path):
    target = TINY_TARGETS["qwen3_5"]()
    drafter, weaver = make_drafters(target)
    drafter.save_pretrained(tmp_path / "dflash")
    weaver.save_pretrained(tmp_path / "weaver")
    drafter2 = AutoModel.from_pretrained(tmp_path / "dflash", trust_remote_code=True).eval()
    weaver2 = AutoModel.from_pretrained(tmp_path / "weaver", trust_remote_code=True).eval()
    ids = prompts()[2]
    for mode in ("weaver", "chain"):
        a, sa = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, max_new_tokens=24,
                                     return_stats=True)
        b, sb = speculative_generate(target, ids, drafter=drafter2, weaver=weaver2, mode=mode, max_new_tokens=24,
                                     return_stats=True)
        assert torch.equal(a, b) and sa.accepted_lengths == sb.accepted_lengths and sa.tree_sizes == sb.tree_sizes


def test_bad_inputs_raise_clear_errors():
    target = TINY_TARGETS["llama"]()
    drafter, weaver = make_drafters(target)
    ids = prompts()[1]
    ok = dict(drafter=drafter, weaver=weaver, max_new_tokens=4)
    with pytest.raises(ValueError, match="batch size 1"):
        speculative_generate(target, ids.repeat(2, 1), **ok)
    with pytest.raises(ValueError, match="empty"):
        speculative_generate(target, ids[:, :0], **ok)
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(target, ids, drafter=drafter, weaver=weaver, max_new_tokens=0)
    with pytest.raises(ValueError, match="tree_budget"):
        speculative_generate(target, ids, tree_budget=0, **ok)
    with pytest.raises(ValueError, match="needs a Weaver"):
        speculative_generate(target, ids, drafter=drafter, mode="weaver", max_new_tokens=4)
    with pytest.raises(ValueError, match="mode must be"):
        speculative_generate(target, ids, mode="beam", **ok)
    with pytest.raises(ValueError, match="temperature"):
        speculative_generate(target, ids, do_sample=True, temperature=0.0, **ok)
    with pytest.raises(ValueError, match="batch size 1"):
        target.generate(ids.repeat(2, 1), custom_generate=generate, drafter=drafter, weaver=weaver,
                        max_new_tokens=4)
    with pytest.raises(ValueError, match="repetition_penalty"):
        target.generate(ids, custom_generate=generate, drafter=drafter, weaver=weaver, max_new_tokens=4,
                        repetition_penalty=1.3)

    def drafter_with(**changes):
        config = DFlashConfig.from_target_config(target.config, num_hidden_layers=1, target_layer_ids=[0])
        for key, value in changes.items():
            if key == "target_layer_ids":
                config.dflash_config = {**config.dflash_config, "target_layer_ids": value}
            else:
                setattr(config, key, value)
        return DFlashDraftModel(config)

    for changes, message in (({"hidden_size": 48}, "hidden_size"), ({"vocab_size": VOCAB + 3}, "vocab_size"),
                             ({"target_layer_ids": [0, 9]}, "target_layer_ids")):
        with pytest.raises(ValueError, match=message):
            speculative_generate(target, ids, drafter=drafter_with(**changes), mode="chain", max_new_tokens=4)
    narrow = WeaverModel(WeaverConfig(**{**weaver.config.to_dict(), "d_model": 16}))
    with pytest.raises(ValueError, match="d_model"):
        speculative_generate(target, ids, drafter=drafter, weaver=narrow, max_new_tokens=4)


def toy_vocab_pair(vocab: int, family: str = "llama"):
    """A tiny Llama (or Qwen3-MoE: 4 experts, top-2; or Mistral: a sliding window of 2, shorter than the 3-token
    prompt) over ``vocab`` tokens and a 1-layer DFlash drafter for it (seeded): the χ² tests' models."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    torch.manual_seed(0)
    shape = dict(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, initializer_range=0.3, eos_token_id=None, bos_token_id=None,
                 pad_token_id=None)
    if family == "qwen3_moe":
        target = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, head_dim=8, moe_intermediate_size=8, num_experts=4,
                                                    num_experts_per_tok=2)).eval()
    elif family == "mistral":
        target = MistralForCausalLM(MistralConfig(**shape, sliding_window=2)).eval()
    else:
        target = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    drafter = DFlashDraftModel(DFlashConfig.from_target_config(
        target.config, num_hidden_layers=1, block_size=4, target_layer_ids=[0])).eval()
    return target, drafter


def three_token_distribution(target, prompt: torch.Tensor, processed) -> torch.Tensor:
    """Exact p(x1, x2, x3) after ``prompt`` by enumeration, each step's logits through ``processed`` → probs."""
    vocab = target.config.vocab_size
    with torch.no_grad():
        seqs = torch.cartesian_prod(*[torch.arange(vocab)] * 2)  # [V², 2]
        p1 = processed(target(prompt).logits[0, -1])
        p2 = processed(target(torch.cat([prompt.expand(vocab, -1), torch.arange(vocab)[:, None]], 1)).logits[:, -1])
        p3 = processed(target(torch.cat([prompt.expand(vocab * vocab, -1), seqs], 1)).logits[:, -1])
    return (p1[:, None, None] * p2[:, :, None] * p3.view(vocab, vocab, vocab)).flatten().double()


@pytest.mark.slow
@pytest.mark.parametrize("mode,verification,spine,family", [
    ("weaver", None, False, "llama"), ("weaver", None, True, "llama"), ("ddtree", None, False, "llama"),
    ("ddtree", "traversal", False, "llama"), ("weaver", None, True, "qwen3_moe"), ("weaver", None, True, "mistral")])
def test_sampling_through_the_loop_is_exact_in_distribution(mode, verification, spine, family, monkeypatch):
    """End to end on a tiny vocabulary: the first three sampled tokens — across a commit and a second step — follow
    the processed target distribution (Weaver trees also as spine trees; a MoE target and a sliding-window one too)."""
    from scipy.stats import chisquare

    vocab, temperature, top_k, draws = 6, 0.7, 3, 3000
    target, drafter = toy_vocab_pair(vocab, family)
    weaver = WeaverModel(WeaverConfig.from_target_config(
        target.config, drafter.config, d_rank=16, num_heads=2, mlp_dim=32, candidate_pool_size=5)).eval()
    prompt = torch.tensor([[1, 5, 2]])

    def processed(logits):
        top = logits / temperature
        top[top < top.topk(top_k).values[..., -1:]] = float("-inf")
        return top.softmax(-1)

    expected = three_token_distribution(target, prompt, processed)

    gen = torch.Generator().manual_seed(123)
    counts = torch.zeros(vocab**3, dtype=torch.float64)
    for _ in range(draws):
        out = speculative_generate(target, prompt, drafter=drafter, weaver=weaver, mode=mode, tree_budget=4,
                                   max_new_tokens=3, do_sample=True, temperature=temperature, top_k=top_k,
                                   verification=verification, generator=gen, tree_policy=TreePolicy(spine=spine))
        x1, x2, x3 = out[0, -3:].tolist()
        counts[(x1 * vocab + x2) * vocab + x3] += 1
    support = expected > 0
    assert counts[~support].sum() == 0, "a token outside the top-k support was emitted"
    exp = expected[support] * draws
    big = exp >= 5  # merge the tiny-expectation cells into one
    obs, exp = counts[support][big], exp[big]
    if not big.all():
        obs = torch.cat([obs, counts[support][~big].sum()[None]])
        exp = torch.cat([exp, (expected[support] * draws)[~big].sum()[None]])
    exp = exp * (obs.sum() / exp.sum())  # the top-k mass sums to 1 only up to rounding
    pvalue = chisquare(obs.numpy(), exp.numpy()).pvalue
    assert pvalue > 0.01, pvalue


def test_target_step_is_checked_and_graph_runs_eagerly_off_cuda():
    target = TINY_TARGETS["qwen3_5"]()
    drafter, weaver = make_drafters(target)
    ids = prompts(1)[0]
    with pytest.raises(ValueError, match="target_step"):
        speculative_generate(target, ids, drafter=drafter, weaver=weaver, target_step="jit")
    got = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode="ddtree", tree_budget=8,
                               max_new_tokens=16, target_step="graph")
    assert torch.equal(got, reference(target, ids, 16))


@pytest.mark.parametrize("name", list(TINY_TARGETS))
def test_static_autoregressive_baseline_equals_generate(name):
    from modeling_weaver.lab.benchmark import autoregressive_generate

    target = TINY_TARGETS[name]()
    for ids in prompts():
        expected = reference(target, ids, 24)
        assert torch.equal(autoregressive_generate(target, ids, 24, target_step="static"), expected)
        assert torch.equal(autoregressive_generate(target, ids, 24), expected)


@pytest.mark.parametrize("target_step", ["eager", "static"])
def test_bf16_drafter_with_fp32_target_stays_exact(target_step):
    """Draft logits only shape trees: a bf16 drafter (projecting with a bf16 copy of the target's head) leaves the
    fp32 target's greedy output unchanged; the cached copy follows in-place weight updates."""
    from modeling_weaver.decoding.drafting import draft_head

    target = TINY_TARGETS["llama"]()
    drafter, weaver = make_drafters(target, mask_token_id=VOCAB - 1)
    drafter = drafter.to(torch.bfloat16)
    for mode in MODES:
        for ids in prompts(2):
            got = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget=10,
                                       max_new_tokens=32, target_step=target_step,
                                       step_options=StepOptions(int8_head=False))  # (CPU default: int8)
            assert torch.equal(got, reference(target, ids, 32)), mode
    head = draft_head(target, torch.bfloat16, int8=False)
    assert head.cast_weight.dtype == torch.bfloat16 and draft_head(target, torch.bfloat16, int8=False) is head
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(2.0)
    assert torch.equal(draft_head(target, torch.bfloat16, int8=False).cast_weight,
                       target.get_output_embeddings().weight.bfloat16())
    # the cached copy does not keep the target's weight alive: both go with the target
    import gc
    import weakref

    from modeling_weaver.decoding.drafting import _WEIGHT_COPIES
    from modeling_weaver.decoding.step_cache import release_static_targets

    weight = weakref.ref(target.get_output_embeddings().weight)
    key = (id(weight()), torch.bfloat16, False)
    assert key in _WEIGHT_COPIES and draft_head(target, torch.float32, int8=False).weight is weight()  # (not cached)
    release_static_targets(target)  # (fixed-shape steps live as long as their models, or until released)
    release_static_targets(drafter)
    del target, drafter, weaver, head
    gc.collect()
    assert weight() is None and key not in _WEIGHT_COPIES


@pytest.mark.parametrize("target_step", ["eager", "static"])
def test_int8_draft_head_stays_exact(target_step, monkeypatch):
    """Drafts through the int8 copy of the lm_head (StepOptions.int8_head) leave the greedy output unchanged."""
    import modeling_weaver.decoding.drafting as drafting

    import weaver_kernels

    calls, int8_linear, cpu_int8_linear = [], weaver_kernels.int8_linear, weaver_kernels.cpu_int8_linear
    monkeypatch.setattr(weaver_kernels, "int8_linear", lambda *a: calls.append(a[1].shape) or int8_linear(*a))
    monkeypatch.setattr(weaver_kernels, "cpu_int8_linear",  # (fbgemm's GEMM on a CPU that has it)
                        lambda x, w: calls.append(tuple(w.packed.unpack()[0].shape)) or cpu_int8_linear(x, w))
    target = TINY_TARGETS["qwen3_5"]()
    drafter, weaver = make_drafters(target, mask_token_id=VOCAB - 1)
    for mode in MODES:
        calls.clear()
        for ids in prompts(2):
            got = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget=10,
                                       max_new_tokens=32, target_step=target_step,
                                       step_options=StepOptions(int8_head=True))
            assert torch.equal(got, reference(target, ids, 32)), mode
        assert calls and all(shape == target.get_output_embeddings().weight.shape for shape in calls), mode
    # the default: on CUDA, and on CPUs with fbgemm's int8 GEMM
    assert drafting.draft_head(target, torch.float32).int8 == weaver_kernels.cpu_int8_available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_draft_head_logits(dtype):
    """The int8 head: rows quantised symmetrically (|q| ≤ 127, one scale each), logits the dequantised product (plus
    the bias), within int8's rounding (≈ 1 % RMS) of the exact logits."""
    from modeling_weaver.decoding.drafting import DraftHead

    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(97, 40, generator=gen) * 40 ** -0.5).to(dtype)
    weight[3] = 0.0  # a zero row
    bias = torch.randn(97, generator=gen).to(dtype)
    hidden = torch.randn(2, 15, 40, generator=gen).to(dtype)
    head = DraftHead(weight, bias, dtype, int8=True)
    assert head.quantised.dtype == torch.int8 and head.quantised.abs().max() == 127 and head.scale[3] == 1.0
    assert head.quantised.float().mul(head.scale[:, None]).sub(weight.float()).abs().max() <= head.scale.max() / 2
    if head.cpu_packed is not None:  # fbgemm's GEMM: the same rows, the activations rounded too (test_packed)
        from test_packed import _within_activation_rounding

        fast = head(hidden)
        assert fast.shape == (2, 15, 97) and fast.dtype == dtype
        _within_activation_rounding(fast.float().view(-1, 97), hidden.float().view(-1, 40), head.quantised,
                                    head.scale, bias.float())
        head.cpu_packed = None  # then the reference: the dequantised product
    got = head(hidden)
    assert got.shape == (2, 15, 97) and got.dtype == dtype
    expected = hidden.float() @ (head.quantised.float() * head.scale[:, None]).T + bias.float()
    torch.testing.assert_close(got.float(), expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
    exact = hidden.float() @ weight.float().T
    rel = ((got.float() - bias.float() - exact).pow(2).mean() / exact.pow(2).mean()).sqrt()
    assert rel < (0.02 if dtype == torch.float32 else 0.03)

"""Fixed-shape steps (CUDA graphs on GPU; the same code eagerly on CPU) equal the dynamic ones."""

import pytest
import torch
from tiny_targets import TINY_TARGETS

from modeling_weaver import DFlashConfig, DFlashDraftModel
from modeling_weaver.captured import StaticDraft
from modeling_weaver.generate import DFlashRunner
from modeling_weaver.target import text_config


def rel(a, b):
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm().clamp_min(1e-12))


@pytest.mark.parametrize("layers", ["full", "sliding"])
def test_static_draft_equals_the_dynamic_runner(layers):
    """Over many steps (a long first context, then accepted paths of 1..block tokens), the static drafter gives the
    dynamic runner's hidden states and logits — also with sliding-window layers causal inside the block."""
    target = TINY_TARGETS["llama"]()
    extra = {} if layers == "full" else dict(layer_types=["sliding_attention", "full_attention"],
                                              use_sliding_window=True, sliding_window=6, max_window_layers=0)
    config = DFlashConfig.from_target_config(target.config, num_hidden_layers=2, block_size=8, target_layer_ids=[0, 1],
                                             **extra)
    torch.manual_seed(0)
    drafter = DFlashDraftModel(config).eval()
    width = len(config.target_layer_ids) * text_config(target.config).hidden_size
    dynamic, static = DFlashRunner(drafter, target), StaticDraft(drafter, target, max_length=128, capture=False)
    gen = torch.Generator().manual_seed(1)
    n = 0
    for step, count in enumerate([19, 3, 1, 8, 5, 2, 8, 1]):
        context = torch.randn(count, width, generator=gen)
        n += count
        bonus = int(torch.randint(97, (1,), generator=gen))
        h1, l1 = dynamic.draft(bonus, context, n)
        h2, l2 = static.draft(bonus, context, n)
        assert rel(h2, h1) < 1e-5 and rel(l2, l1) < 1e-5, step
    with pytest.raises(ValueError, match="beyond"):
        static.draft(0, torch.randn(1, width), 130)


@pytest.mark.parametrize("mode", ["chain", "ddtree", "weaver"])
def test_static_proposer_gives_the_eager_draft_and_tree(mode):
    from test_generate import make_drafters

    from modeling_weaver.tree import chain_tree, ddtree, weaver_tree

    target = TINY_TARGETS["qwen3_5"]()
    drafter, weaver = make_drafters(target)
    hidden_size = text_config(target.config).hidden_size
    width = len(drafter.config.target_layer_ids) * hidden_size
    dynamic = DFlashRunner(drafter, target)
    proposer = StaticDraft(drafter, target, max_length=96, capture=False).proposer(mode, 10, weaver)
    gen = torch.Generator().manual_seed(2)
    n = 0
    for count in (13, 2, 5):
        context = torch.randn(count, width, generator=gen)
        last_hidden = torch.randn(hidden_size, generator=gen)
        n += count
        h1, l1 = dynamic.draft(7, context, n)
        h2, l2, tree = proposer.propose(7, context, n, last_hidden)
        assert rel(h2, h1) < 1e-5 and rel(l2, l1) < 1e-5
        if mode == "chain":
            expected = chain_tree(7, l1, 10)
        elif mode == "ddtree":
            expected = ddtree(7, l1, 10)
        else:
            depth = min(h1.shape[0], weaver.config.K)
            prompt = weaver.encode_prompt(last_hidden[None], h1[None, :depth])
            expected = weaver_tree(7, weaver, prompt, l1, target.get_input_embeddings(),
                                   target.get_output_embeddings().weight, 10)
        assert torch.equal(tree.tokens, expected.tokens) and torch.equal(tree.parents, expected.parents)
        assert torch.allclose(tree.logq, expected.logq, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
@pytest.mark.parametrize("mode", ["chain", "ddtree", "weaver"])
def test_fused_greedy_steps_are_exact_with_deep_acceptance(name, mode):
    """Whole steps on the device (draft + tree, verify, greedy accept, commit): a drafter whose marginals are
    planted with the target's own continuation (wrong at ~15 % of depths) gets long paths accepted, and the output
    is still exactly greedy decoding."""
    from test_generate import make_drafters, reference
    from transformers.generation import LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList

    from modeling_weaver.captured import static_draft
    from modeling_weaver.generate import PhaseTimer, _decode

    torch.manual_seed(0)
    target = TINY_TARGETS[name]()
    drafter, weaver = make_drafters(target, mask_token_id=None if name == "qwen3_5" else 96)
    with torch.no_grad():  # Weaver then follows the planted marginals
        weaver.lm_head_query_in.weight.zero_()
    ids = torch.randint(0, 97, (1, 9))
    new = 64
    ref = reference(target, ids, new + 40)[0]
    draft = static_draft(drafter, target, ids.shape[1] + new + 40, capture=False)

    def plant(logits):
        depth = logits.shape[0]
        rows = torch.arange(depth)
        true = ref[(draft.n + 1 + rows).clamp(max=ref.shape[0] - 1)]
        bump = torch.where(torch.rand(depth) < 0.15, 0.0, 12.0).to(logits.dtype)
        return logits.index_put((rows, true), logits[rows, true] + bump)

    proposer = draft.proposer(mode, 24, weaver if mode == "weaver" else None, shape_logits=plant)
    timer = PhaseTimer(torch.device("cpu"))
    got, stats = _decode(
        target, ids[0], runner=proposer, weaver=weaver, mode=mode, tree_budget=24, max_new_tokens=new,
        processors=LogitsProcessorList(), do_sample=False, verification=None,
        stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(ids.shape[1] + new)]), streamer=None,
        generator=None, target_step="static", timer=timer,
    )
    assert torch.equal(got[0], ref[: ids.shape[1] + new])
    assert "step" in stats.phase_ms and len(timer.spans["step"]) == stats.num_steps - 1  # all fused but the first
    assert max(stats.accepted_lengths) >= 6 and stats.mean_accepted_length > 2.5, stats.accepted_lengths

"""Bad inputs at the API boundary (issue 28, item 5): each raises a TypeError / ValueError naming the argument and
what is allowed, before any work; generation-config processors with an eos id are applied exactly; a tokenizer's
``attention_mask`` is accepted when it masks nothing and refused when it pads."""

from __future__ import annotations

import copy

import pytest
import torch
from test_generate import make_drafters
from tiny_targets import VOCAB, tiny_llama

from modeling_weaver import generate, speculative_generate


@pytest.fixture(scope="module")
def models():
    target = tiny_llama()
    drafter, weaver = make_drafters(target)
    return target, drafter, weaver


IDS = torch.tensor([[3, 7, 11, 2]])


def spec(models, ids=IDS, **kwargs):
    target, drafter, weaver = models
    kwargs = {"drafter": drafter, "weaver": weaver, "mode": "ddtree", "tree_budget": 4, "max_new_tokens": 4,
              **kwargs}
    return speculative_generate(target, ids, **kwargs)


def via_hf(models, ids=IDS, **kwargs):
    target, drafter, weaver = models
    kwargs = {"drafter": drafter, "weaver": weaver, "mode": "ddtree", "tree_budget": 4, "max_new_tokens": 4,
              **kwargs}
    kwargs.setdefault("attention_mask", torch.ones_like(ids))
    return target.generate(ids, custom_generate=generate, **kwargs)


def raises(kind, argument, call, *args, **kwargs):
    with pytest.raises(kind) as info:
        call(*args, **kwargs)
    assert argument in str(info.value), str(info.value)
    return str(info.value)


def test_float_input_ids(models):
    message = raises(TypeError, "input_ids", spec, models, IDS.float())
    assert "torch.long" in message


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 50, -1])
def test_token_ids_outside_the_vocabulary(models, bad):
    ids = IDS.clone()
    ids[0, 1] = bad
    message = raises(ValueError, "input_ids", spec, models, ids)
    assert f"[0, {VOCAB - 1}]" in message


@pytest.mark.parametrize("budget", [True, False, 4.0, "8"])
def test_tree_budget_must_be_an_int(models, budget):
    raises(TypeError, "tree_budget", spec, models, tree_budget=budget)
    raises(TypeError, "tree_budget", via_hf, models, tree_budget=budget)


def test_tree_budget_defaults_to_the_devices(models, monkeypatch):
    """No budget given: the device's default (5 on CPU), which the loop then builds trees of."""
    from modeling_weaver.decoding import loop
    from modeling_weaver.tree import default_tree_budget

    assert default_tree_budget("cpu") == 5 and default_tree_budget(torch.device("cuda", 0)) == 64
    seen = []
    real = loop.plan_steps
    monkeypatch.setattr(loop, "plan_steps", lambda *a, **k: seen.append(k["tree_budget"]) or real(*a, **k))
    target, drafter, weaver = models
    speculative_generate(target, IDS, drafter=drafter, weaver=weaver, mode="ddtree", max_new_tokens=4)
    target.generate(IDS, custom_generate=generate, drafter=drafter, weaver=weaver, mode="ddtree", max_new_tokens=4)
    assert seen == [5, 5]


def test_tree_mode_defaults_to_the_devices(models, monkeypatch):
    """No mode given: Weaver trees on accelerators when a Weaver is given, DDTree otherwise (on a CPU always); the
    stats say which ran, and a given mode is kept. Every mode gives the AR tokens."""
    from modeling_weaver.decoding import loop
    from modeling_weaver.tree import default_tree_mode

    cuda = torch.device("cuda", 0)
    assert default_tree_mode("cpu", weaver=object()) == default_tree_mode("cpu") == "ddtree"
    assert default_tree_mode(cuda, weaver=object()) == "weaver" and default_tree_mode(cuda) == "ddtree"
    seen = []
    real = loop.plan_steps
    monkeypatch.setattr(loop, "plan_steps", lambda *a, **k: seen.append((k["mode"], k["weaver"])) or real(*a, **k))
    target, drafter, weaver = models
    expected = target.generate(IDS, max_new_tokens=6, do_sample=False)
    got, stats = speculative_generate(target, IDS, drafter=drafter, weaver=weaver, max_new_tokens=6,
                                      return_stats=True)
    assert torch.equal(got, expected) and stats.mode == "ddtree"
    via = target.generate(IDS, custom_generate=generate, drafter=drafter, weaver=weaver, max_new_tokens=6)
    assert torch.equal(via, expected)
    got, stats = speculative_generate(target, IDS, drafter=drafter, weaver=weaver, mode="weaver", max_new_tokens=6,
                                      return_stats=True)
    assert torch.equal(got, expected) and stats.mode == "weaver"
    # (a DDTree generation is not handed the Weaver: nothing of it is packed or called)
    assert seen == [("ddtree", None), ("ddtree", None), ("weaver", weaver)]


def test_sampling_without_temperature(models):
    message = raises(TypeError, "temperature", spec, models, do_sample=True, temperature=None)
    assert "do_sample" in message
    raises(TypeError, "do_sample", spec, models, do_sample="yes")


def test_drafter_and_weaver_swapped(models):
    target, drafter, weaver = models
    message = raises(TypeError, "drafter=", spec, models, drafter=weaver, weaver=drafter)
    assert "swapped" in message and "weaver=" in message
    raises(TypeError, "weaver=", spec, models, weaver=drafter)
    raises(TypeError, "drafter=", via_hf, models, drafter=weaver, weaver=drafter)
    raises(TypeError, "target=", speculative_generate, drafter, IDS, drafter=drafter, mode="chain")


@pytest.mark.parametrize("eos", ["abc", 1.5, ["abc"], [3, None], True])
def test_eos_token_id_kind(models, eos):
    raises(TypeError, "eos_token_id", spec, models, eos_token_id=eos)


@pytest.mark.parametrize("eos", [-1, VOCAB, [2, VOCAB + 3]])
def test_eos_token_id_range(models, eos):
    raises(ValueError, "eos_token_id", spec, models, eos_token_id=eos)


@pytest.mark.parametrize("role", ["drafter", "weaver"])
def test_model_on_the_meta_device(models, role):
    target, drafter, weaver = models
    with torch.device("meta"):
        empty = type(drafter if role == "drafter" else weaver)(
            copy.deepcopy((drafter if role == "drafter" else weaver).config))
    message = raises(ValueError, f"{role}=", spec, models, **{role: empty})
    assert "meta" in message


def test_attention_mask_from_a_tokenizer(models):
    """``speculative_generate(target, **tokenizer(text, return_tensors="pt"), ...)``: an all-ones mask is accepted
    (same output as without it); a padding mask is refused by name."""
    target, drafter, weaver = models
    encoded = {"input_ids": IDS, "attention_mask": torch.ones_like(IDS)}
    out = speculative_generate(target, **encoded, drafter=drafter, mode="chain", tree_budget=4, max_new_tokens=5)
    assert torch.equal(out, spec(models, mode="chain", max_new_tokens=5))
    padded = torch.tensor([[0, 1, 1, 1]])
    message = raises(ValueError, "attention_mask", spec, models, attention_mask=padded)
    assert "padd" in message
    raises(ValueError, "attention_mask", spec, models, attention_mask=torch.ones(1, 2, dtype=torch.long))
    raises(TypeError, "attention_mask", spec, models, attention_mask=[[1, 1, 1, 1]])
    raises(ValueError, "attention_mask", via_hf, models, attention_mask=padded)


@pytest.mark.parametrize("field,value", [("bad_words_ids", [[5], [7]]), ("exponential_decay_length_penalty", (2, 1.6))])
def test_processors_with_an_eos_id_are_applied_exactly(field, value):
    """A target generation_config with ``bad_words_ids`` / ``exponential_decay_length_penalty`` and an eos id: the
    same tokens as ``target.generate``, through both entry points (once an AttributeError about
    ``_eos_token_tensor``)."""
    target = tiny_llama()
    drafter, weaver = make_drafters(target)
    setattr(target.generation_config, field, value)
    target.generation_config.eos_token_id = 9
    target.generation_config.pad_token_id = 0
    expected = target.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=12)
    for mode in ("chain", "ddtree", "weaver"):
        out = speculative_generate(target, IDS, drafter=drafter, weaver=weaver, mode=mode, tree_budget=6,
                                   max_new_tokens=12)
        assert torch.equal(out, expected), mode
    out = target.generate(IDS, attention_mask=torch.ones_like(IDS), custom_generate=generate, drafter=drafter,
                          weaver=weaver, mode="ddtree", tree_budget=6, max_new_tokens=12)
    assert torch.equal(out, expected)
    out = speculative_generate(target, IDS, drafter=drafter, weaver=weaver, mode="chain", tree_budget=6,
                               max_new_tokens=12, eos_token_id=[9, 4])
    assert torch.equal(out, target.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=12,
                                            eos_token_id=[9, 4]))


def test_good_inputs_still_pass(models):
    """The checks accept what the API documents: int eos ids (one or several), a bool do_sample, int budgets."""
    assert spec(models, eos_token_id=[1, 2]).shape[1] >= IDS.shape[1] + 1
    assert spec(models, eos_token_id=torch.tensor([1, 2])).shape[0] == 1
    assert spec(models, do_sample=True, temperature=0.7, generator=torch.Generator().manual_seed(0)).shape[0] == 1
    assert spec(models, ids=IDS.int()).shape[0] == 1  # int32 ids are token ids too

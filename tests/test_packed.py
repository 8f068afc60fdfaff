"""pack_cpu_linears: prepacked oneDNN CPU linears, the same models' outputs, a lossless loop on them, and the ways
back to F.linear (other devices/dtypes, autograd, changed weights, unpacking). int8_linears: a drafter's linears on
int8 weights (the op's torch reference here), its outputs those of the dequantised weights, a lossless loop."""

from __future__ import annotations

import pytest
import torch
from test_generate import make_drafters, prompts, reference
from tiny_targets import TINY_TARGETS

import weaver_kernels
from modeling_weaver import (int8_linears, pack_cpu_linears, remove_int8_linears, speculative_generate,
                             unpack_cpu_linears)
from modeling_weaver.packed import _INT8, _PACKED

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (mkldnn)")


def _linears(*models):
    return [m for model in models for m in model.modules() if type(m) is torch.nn.Linear]


@needs_onednn
@pytest.mark.parametrize("kind", sorted(TINY_TARGETS))
def test_packed_models_keep_their_outputs_and_the_loop_stays_lossless(kind):
    target = TINY_TARGETS[kind]()
    drafter, weaver = make_drafters(target)
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = target(ids).logits
    n = pack_cpu_linears(target, drafter, weaver)
    assert n == len(_linears(target, drafter, weaver)) > 0
    assert all("forward" in m.__dict__ for m in _linears(target, drafter, weaver))
    with torch.no_grad():
        torch.testing.assert_close(target(ids).logits, before, rtol=1e-5, atol=1e-5)
    for ids in prompts():
        expected = reference(target, ids, 24)  # transformers' generate on the same (packed) model
        for mode in ("chain", "ddtree", "weaver"):
            got = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget=8,
                                       max_new_tokens=24)
            assert torch.equal(got, expected), mode
    assert pack_cpu_linears(target) == 0  # already packed
    assert unpack_cpu_linears(target, drafter, weaver) == n
    assert not any("forward" in m.__dict__ or hasattr(m, _PACKED) for m in _linears(target, drafter, weaver))


@needs_onednn
def test_packed_linear_follows_its_weight_and_falls_back():
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 48)
    ref = torch.nn.Linear(32, 48)
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(5, 32)
    assert pack_cpu_linears(lin) == 1
    with torch.no_grad():
        torch.testing.assert_close(lin(x), ref(x))
        lin.weight.mul_(2.0)  # changed in place: re-packed at the next call
        ref.weight.mul_(2.0)
        torch.testing.assert_close(lin(x), ref(x))
    lin.weight = torch.nn.Parameter(torch.randn(48, 32))  # replaced
    ref.weight = torch.nn.Parameter(lin.weight.detach().clone())
    with torch.no_grad():
        torch.testing.assert_close(lin(x), ref(x))
    # autograd takes F.linear: gradients reach the weight
    lin(x).sum().backward()
    assert lin.weight.grad is not None and torch.equal(lin.weight.grad, x.sum(0).expand(48, 32))
    # another dtype than the weight's: F.linear (and its error), not the packed form
    with pytest.raises(RuntimeError):
        lin(x.double())
    # not packed: float64 weights, subclasses of Linear
    assert pack_cpu_linears(torch.nn.Linear(4, 4).double()) == 0
    assert pack_cpu_linears(torch.nn.LazyLinear(4)) == 0


@pytest.mark.parametrize("kind", ["qwen3_5", "llama"])
def test_int8_drafter_keeps_the_loop_lossless(kind):
    """A drafter on int8 linears computes what the same drafter with its weights rounded to the int8 grid computes,
    and the loop's greedy output stays the target's in every mode."""
    import copy

    target = TINY_TARGETS[kind]()
    drafter, weaver = make_drafters(target)
    rounded = copy.deepcopy(drafter)
    with torch.no_grad():
        for m in _linears(rounded):
            q, scale = weaver_kernels.quantize_rows(m.weight)
            m.weight.copy_(q.float() * scale[:, None])
    from modeling_weaver.decoding.step_cache import _STATIC_TARGETS

    _STATIC_TARGETS[drafter] = {"traced through the old forward": object()}
    n = int8_linears(drafter)
    assert n == len(_linears(drafter)) > 0 and all(hasattr(m, _INT8) for m in _linears(drafter))
    assert drafter not in _STATIC_TARGETS  # its cached steps are dropped
    assert int8_linears(drafter) == 0  # already routed
    feats = torch.randn(1, 5, drafter.fc.in_features, generator=torch.Generator().manual_seed(2))
    block = torch.randn(1, drafter.block_size, drafter.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        kwargs = dict(noise_embedding=block, target_hidden=feats,
                      position_ids=torch.arange(5 + drafter.block_size)[None])
        torch.testing.assert_close(drafter(**kwargs), rounded(**kwargs), rtol=1e-5, atol=1e-5)
    for ids in prompts(2):
        expected = reference(target, ids, 24)
        for mode in ("chain", "ddtree", "weaver"):
            got = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget=8,
                                       max_new_tokens=24)
            assert torch.equal(got, expected), mode
    _STATIC_TARGETS[drafter] = {"traced through the int8 forward": object()}
    assert remove_int8_linears(drafter) == n and drafter not in _STATIC_TARGETS
    assert not any("forward" in m.__dict__ or hasattr(m, _INT8) for m in _linears(drafter))


def test_int8_linear_falls_back_for_many_rows_and_autograd():
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 48)
    weight = lin.weight.detach().clone()
    assert int8_linears(lin, max_rows=4) == 1
    q, scale = getattr(lin, _INT8)
    x = torch.randn(4, 32)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), x @ (q.float() * scale[:, None]).T + lin.bias)
    many = torch.randn(2, 3, 32)  # 6 rows > max_rows: the original weight
    with torch.no_grad():
        torch.testing.assert_close(lin(many), torch.nn.functional.linear(many, weight, lin.bias))
    lin(x).sum().backward()  # autograd takes F.linear: gradients reach the weight
    assert torch.equal(lin.weight.grad, x.sum(0).expand(48, 32))


@needs_onednn
def test_generation_on_cpu_packs_inside_the_call_only(monkeypatch):
    """By default a CPU generation runs on packed linears (StepOptions.packed_linears) and leaves the models as they
    were: no routed forward after it (transformers' generate unchanged), deep-copyable, the copies kept off the
    modules for the next call; off when asked, or when the copies would not fit the memory rule."""
    import copy

    from modeling_weaver import StepOptions
    from modeling_weaver import packed as packed_module

    target = TINY_TARGETS["llama"]()
    drafter, weaver = make_drafters(target)
    linears = _linears(target, drafter, weaver)
    ids = prompts(1)[0]
    expected = reference(target, ids, 16)
    routed = []
    real = packed_module._packed_forward

    def spy(module, state):  # records which modules the call routed
        routed.append(module)
        return real(module, state)

    monkeypatch.setattr(packed_module, "_packed_forward", spy)
    got = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode="weaver", tree_budget=8,
                               max_new_tokens=16)
    assert torch.equal(got, expected) and set(routed) == set(linears)
    assert not any("forward" in m.__dict__ or hasattr(m, _PACKED) for m in linears)
    assert all(m in packed_module._PACKED_COPIES for m in linears)
    copies = {m: packed_module._PACKED_COPIES[m][0] for m in linears}
    copy.deepcopy(target)  # nothing opaque on the modules
    routed.clear()
    speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode="ddtree", tree_budget=8, max_new_tokens=4)
    assert set(routed) == set(linears) and all(packed_module._PACKED_COPIES[m][0] is copies[m] for m in linears)
    assert unpack_cpu_linears(target, drafter, weaver) == len(linears)
    assert not any(m in packed_module._PACKED_COPIES for m in linears)
    routed.clear()
    off = StepOptions(packed_linears=False)
    got = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode="chain", tree_budget=8,
                               max_new_tokens=16, step_options=off)
    assert torch.equal(got, expected) and not routed and not any(m in packed_module._PACKED_COPIES for m in linears)
    monkeypatch.setattr(packed_module, "_available_memory", lambda: 1024)  # the copies would not fit
    assert not packed_module.packing_fits(target, drafter, weaver)
    speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode="chain", tree_budget=8, max_new_tokens=4)
    assert not routed
    speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode="chain", tree_budget=8, max_new_tokens=4,
                         step_options=StepOptions(packed_linears=True))  # asked for: packed whatever the rule
    assert set(routed) == set(linears)
    unpack_cpu_linears(target, drafter, weaver)


@needs_onednn
def test_drafts_project_through_the_packed_lm_head_for_the_depths_a_tree_can_use(monkeypatch):
    """A drafter in the target's dtype projects through the target's lm_head module (so through its packed weight
    in a CPU generation), and only for the depths a tree of the budget can reach; the output stays AR's."""
    from test_generate import BLOCK

    from modeling_weaver import packed as packed_module
    from modeling_weaver.decoding.drafting import DFlashRunner

    target = TINY_TARGETS["llama"]()
    drafter, weaver = make_drafters(target)
    head = target.get_output_embeddings()
    rows = []
    real = packed_module._packed_forward

    def spy(module, state):  # records the rows of each packed lm_head call
        forward = real(module, state)
        return (lambda x: rows.append(x.shape[-2]) or forward(x)) if module is head else forward

    monkeypatch.setattr(packed_module, "_packed_forward", spy)
    ids = prompts(1)[0]
    for mode in ("ddtree", "weaver"):
        rows.clear()
        got = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget=3,
                                   max_new_tokens=12)
        assert torch.equal(got, reference(target, ids, 12)), mode
        assert 3 in rows and max(rows) >= 4, rows  # the drafts' 3 depths; the verify's 4 nodes and the prompt
        assert BLOCK - 1 not in rows, rows  # never the whole block
    unpack_cpu_linears(target, drafter, weaver)
    width = len(drafter.config.target_layer_ids) * target.config.hidden_size
    context = torch.randn(5, width, generator=torch.Generator().manual_seed(0))
    hidden, logits = DFlashRunner(drafter, target).draft(3, context, 5)
    cut_hidden, cut = DFlashRunner(drafter, target).draft(3, context, 5, depths=2)
    assert logits.shape[0] == BLOCK - 1 and cut.shape[0] == 2 and torch.equal(cut_hidden, hidden)
    torch.testing.assert_close(cut, logits[:2])


def test_bf16_linears_are_packed_only_where_the_cpu_has_bf16_kernels(monkeypatch):
    from modeling_weaver import packed as packed_module

    monkeypatch.setattr(packed_module, "_packable_dtypes", lambda: (torch.float32,))
    assert pack_cpu_linears(torch.nn.Linear(8, 8).bfloat16()) == 0  # (oneDNN's reorder would refuse it there)
    if torch.backends.mkldnn.is_available():
        assert pack_cpu_linears(torch.nn.Linear(8, 8)) == 1

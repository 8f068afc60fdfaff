"""pack_cpu_linears: prepacked oneDNN CPU linears, the same models' outputs, a lossless loop on them, and the ways
back to F.linear (other devices/dtypes, autograd, changed weights, unpacking). int8_linears: a drafter's linears on
int8 weights (the op's torch reference, and fbgemm's int8 GEMM within its rounding bound), its outputs those of the
dequantised weights, a lossless loop; the drafter's int8 lm_head on CPU."""

from __future__ import annotations

import pytest
import torch
from test_generate import make_drafters, prompts, reference
from tiny_targets import TINY_TARGETS

import weaver_kernels
from modeling_weaver import (StepOptions, int8_linears, pack_cpu_linears, remove_int8_linears,
                             speculative_generate, unpack_cpu_linears)
from modeling_weaver.packed import _INT8, _PACKED

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (mkldnn)")
needs_fbgemm = pytest.mark.skipif(not weaver_kernels.cpu_int8_available(), reason="needs torch's int8 GEMM (x86)")


def _within_activation_rounding(out, x, q, scale, bias=None):
    """``out`` is ``x @ (q · scale).T (+ bias)`` up to rounding each row of ``x`` to its own 7-bit grid (step max |x_r|
    / 63), whose error in output (r, i) is at most half row r's step times Σ_j |w_ij|."""
    w = q.double() * scale.double()[:, None]
    ref = x.double() @ w.T + (0 if bias is None else bias.double())
    step = x.double().abs().amax(-1, keepdim=True) / 63
    bound = 0.5 * step * w.abs().sum(1) * 1.001 + 1e-5
    assert (out.double() - ref).abs().le(bound).all(), float(((out.double() - ref).abs() / bound).max())
    return (out.double() - ref).abs().max()


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
    packs = {m: getattr(m, _INT8) for m in _linears(drafter)}
    assert all((p[2] is not None) == weaver_kernels.cpu_int8_available() for p in packs.values())
    for m, (q, scale, _) in packs.items():  # the reference path: exactly the rounded weights
        setattr(m, _INT8, (q, scale, None))
    feats = torch.randn(1, 5, drafter.fc.in_features, generator=torch.Generator().manual_seed(2))
    block = torch.randn(1, drafter.block_size, drafter.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        kwargs = dict(noise_embedding=block, target_hidden=feats,
                      position_ids=torch.arange(5 + drafter.block_size)[None])
        torch.testing.assert_close(drafter(**kwargs), rounded(**kwargs), rtol=1e-5, atol=1e-5)
    for m, pack in packs.items():  # (the loop below: fbgemm's GEMM where the CPU has it)
        setattr(m, _INT8, pack)
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
    q, scale, packed = getattr(lin, _INT8)
    x = torch.randn(4, 32)
    with torch.no_grad():
        if packed is None:
            torch.testing.assert_close(lin(x), x @ (q.float() * scale[:, None]).T + lin.bias)
        else:
            _within_activation_rounding(lin(x), x, q, scale, lin.bias)
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
    # (a DDTree generation never calls the Weaver: its linears are left alone, their copies kept)
    assert set(routed) == set(_linears(target, drafter))
    assert all(packed_module._PACKED_COPIES[m][0] is copies[m] for m in linears)
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
    assert set(routed) == set(_linears(target, drafter))  # (a chain generation: the Weaver is not its)
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
                                   max_new_tokens=12, step_options=StepOptions(int8_head=False))
        assert torch.equal(got, reference(target, ids, 12)), mode
        assert 3 in rows and max(rows) >= 4, rows  # the drafts' 3 depths; the verify's 4 nodes and the prompt
        assert BLOCK - 1 not in rows, rows  # never the whole block
    unpack_cpu_linears(target, drafter, weaver)
    width = len(drafter.config.target_layer_ids) * target.config.hidden_size
    context = torch.randn(5, width, generator=torch.Generator().manual_seed(0))
    fp32 = StepOptions(int8_head=False)  # (fbgemm's int8 head rounds the rows of a call with one scale)
    hidden, logits = DFlashRunner(drafter, target, fp32).draft(3, context, 5)
    cut_hidden, cut = DFlashRunner(drafter, target, fp32).draft(3, context, 5, depths=2)
    assert logits.shape[0] == BLOCK - 1 and cut.shape[0] == 2 and torch.equal(cut_hidden, hidden)
    torch.testing.assert_close(cut, logits[:2])


def test_bf16_linears_are_packed_only_where_the_cpu_has_bf16_kernels(monkeypatch):
    from modeling_weaver import packed as packed_module

    monkeypatch.setattr(packed_module, "_packable_dtypes", lambda: (torch.float32,))
    assert pack_cpu_linears(torch.nn.Linear(8, 8).bfloat16()) == 0  # (oneDNN's reorder would refuse it there)
    if torch.backends.mkldnn.is_available():
        assert pack_cpu_linears(torch.nn.Linear(8, 8)) == 1


@needs_fbgemm
def test_cpu_int8_gemm_is_the_rows_up_to_activation_rounding():
    """fbgemm's GEMM on quantize_rows' own int8 values: within half a 7-bit activation step of the dequantised product
    for every output (and not exact: the activations are rounded), bias included, in the input's dtype."""
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(300, 64, generator=g), torch.randn(300, generator=g)
    q, scale = weaver_kernels.quantize_rows(weight)
    packed = weaver_kernels.cpu_int8_pack(q, scale, bias)
    for rows in (1, 9):
        x = torch.randn(rows, 64, generator=g) * 3
        err = _within_activation_rounding(weaver_kernels.cpu_int8_linear(x, packed), x, q, scale, bias)
        assert err > 0
    assert weaver_kernels.cpu_int8_linear(x.bfloat16(), packed).dtype == torch.bfloat16


@needs_fbgemm
def test_cpu_int8_gemm_rows_do_not_depend_on_the_call():
    """Each row is rounded on its own grid: a row's output is the same bits alone or beside rows of other ranges (a
    draft's depth-d logits do not depend on how many depths are projected); one activation scale per call, the
    negative control, changes the small row's output once a large row joins it."""
    g = torch.Generator().manual_seed(0)
    q, scale = weaver_kernels.quantize_rows(torch.randn(300, 64, generator=g))
    packed = weaver_kernels.cpu_int8_pack(q, scale)
    x = torch.randn(5, 64, generator=g) * torch.tensor([0.1, 1.0, 30.0, 3.0, 0.0])[:, None]
    whole = weaver_kernels.cpu_int8_linear(x, packed)
    for rows in (slice(0, 1), slice(0, 2), slice(1, 4), slice(4, 5)):
        assert torch.equal(weaver_kernels.cpu_int8_linear(x[rows], packed), whole[rows])
    assert torch.equal(whole[4], torch.zeros(300))  # (a zero row: no division by zero)
    one_scale = lambda rows: torch.ops.quantized.linear_dynamic(rows.contiguous(), packed.packed, True)  # noqa: E731
    assert not torch.equal(one_scale(x[:1]), one_scale(x)[:1])


@needs_fbgemm
def test_drafts_on_cpu_take_the_int8_head_by_default():
    """On a CPU with torch's int8 GEMM the drafter's lm_head is fbgemm's int8 copy by default (StepOptions.int8_head
    None), the fp32 head when asked; logits within the rounding bound of the int8 rows; the loop stays lossless."""
    from modeling_weaver.decoding.drafting import draft_head

    target = TINY_TARGETS["llama"]()
    drafter, weaver = make_drafters(target)
    head = draft_head(target, torch.float32)
    assert head.int8 and head.cpu_packed is not None
    assert not draft_head(target, torch.float32, int8=False).int8
    hidden = torch.randn(3, target.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _within_activation_rounding(head(hidden), hidden, head.quantised, head.scale)
    ids = prompts(1)[0]
    for mode in ("chain", "ddtree", "weaver"):
        got = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget=8,
                                   max_new_tokens=16)
        assert torch.equal(got, reference(target, ids, 16)), mode

"""The loop on a GPU, with the Triton tree kernels on: greedy output stays token-identical to AR (skipped on CPU)."""

import pytest
import torch
from test_generate import make_drafters, prompts, reference, run_oracle
from tiny_targets import KEY_TEST_TARGETS, TINY_TARGETS
from transformers.generation import LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList

from modeling_weaver import int8_linears, speculative_generate
from modeling_weaver.generate import MODES, DFlashRunner, _decode
from modeling_weaver.target import text_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("target_step", ["eager", "graph"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(KEY_TEST_TARGETS))
def test_greedy_identity_on_gpu(name, mode, target_step):
    # fp32 so that the comparison with transformers' own (torch) GDN path is not decided by bf16 rounding
    target = KEY_TEST_TARGETS[name]().cuda()
    drafter, weaver = make_drafters(target, mask_token_id=None if name == "qwen3_5" else 96)
    drafter, weaver = drafter.cuda(), weaver.cuda()
    for ids in prompts():
        ids = ids.cuda()
        _, weaver = make_drafters(target)
        weaver = weaver.cuda()
        expected = reference(target, ids, 48)
        got = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget=12,
                                   max_new_tokens=48, target_step=target_step)
        assert torch.equal(got, expected), (name, mode)

        with torch.no_grad():  # Weaver then follows the planted marginals (as in test_generate)
            weaver.lm_head_query_in.weight.zero_()
        got, stats = run_oracle(target, weaver, ids, mode, 24, 48, target_step=target_step)
        assert torch.equal(got, expected), (name, mode, "oracle")
        assert stats.mean_accepted_length > 2.5


@pytest.mark.parametrize("peel", [True, False])
@pytest.mark.parametrize("mode", ["ddtree", "weaver"])
def test_peeled_root_identity_on_gpu(mode, peel, monkeypatch):
    """GDN verify with the root as a recurrent step (peel_root, the default; budgets 16 and 32: trees of 17 and 33
    nodes) and without it keeps the hybrid target's greedy output token-identical, eager and graph steps."""
    from modeling_weaver.options import StepOptions

    target = TINY_TARGETS["qwen3_5"]().cuda()
    drafter, weaver = (m.cuda() for m in make_drafters(target, mask_token_id=None))
    for ids in prompts():
        ids = ids.cuda()
        expected = reference(target, ids, 48)
        for budget, target_step in ((16, "eager"), (32, "graph")):
            got = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget=budget,
                                       max_new_tokens=48, target_step=target_step,
                                       step_options=StepOptions(peel_root=peel))
            assert torch.equal(got, expected), (mode, budget, target_step)


@pytest.mark.parametrize("mode", ["ddtree", "weaver"])
def test_neumann_verify_identity_on_gpu(mode, monkeypatch):
    """Budget 64 (65 nodes: the root step, then 64 nodes of depth ≤ block size − 1): the GDN layers take the Neumann
    verify, and the hybrid target's greedy output stays token-identical, eager and graph steps."""
    from weaver_kernels.gdn_tree import chunk

    taken = []
    real = chunk.verify_neumann
    monkeypatch.setattr(chunk, "verify_neumann", lambda *a: (taken.append(a[-1]), real(*a)))
    target = TINY_TARGETS["qwen3_5"]().cuda()
    drafter, weaver = (m.cuda() for m in make_drafters(target, mask_token_id=None))
    for ids in prompts():
        ids = ids.cuda()
        expected = reference(target, ids, 48)
        for target_step in ("eager", "graph"):
            got = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget=64,
                                       max_new_tokens=48, target_step=target_step)
            assert torch.equal(got, expected), (mode, target_step)
    assert taken and set(taken) == {1}  # the Neumann form with the root step


@pytest.mark.parametrize("spine", [True, False])
def test_spine_trees_identity_on_gpu(spine, monkeypatch):
    """Weaver spine trees (TreePolicy.spine: the Triton expand kernel with a spine, best_known on the device) and
    best-first rounds at budgets 12 and 64: greedy output token-identical to transformers in eager, graph and
    compiled steps."""
    from modeling_weaver.options import TreePolicy

    target = TINY_TARGETS["qwen3_5"]().cuda()
    drafter, weaver = (m.cuda() for m in make_drafters(target, mask_token_id=None))
    for ids in prompts():
        ids = ids.cuda()
        expected = reference(target, ids, 48)
        for budget, target_step in ((12, "eager"), (64, "graph"), (12, "compiled")):
            got = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode="weaver",
                                       tree_budget=budget, max_new_tokens=48, target_step=target_step,
                                       tree_policy=TreePolicy(spine=spine))
            assert torch.equal(got, expected), (budget, target_step)


def test_int8_draft_head_on_gpu():
    """The drafter's int8 lm_head (StepOptions.int8_head, on by default on CUDA) at the Qwen3.6-27B hidden size:
    logits equal to its dequantised operands' product; greedy output token-identical to transformers in eager, graph
    and compiled steps for every mode (the tiny targets' drafters are fp32: the kernel multiplies in bf16), then with
    the drafter's linears on int8 weights as well."""
    import modeling_weaver.decoding.drafting as drafting

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(248320 // 16, 5120, generator=gen).mul_(5120 ** -0.5).bfloat16()
    hidden = torch.randn(15, 5120, generator=gen).bfloat16()
    head = drafting.DraftHead(weight.cuda(), None, torch.bfloat16, int8=True)
    expected = hidden.float() @ (head.quantised.cpu().float() * head.scale.cpu()[:, None]).T
    torch.testing.assert_close(head(hidden.cuda()).float().cpu(), expected, rtol=1e-2, atol=1e-2)

    target = TINY_TARGETS["qwen3_5"]().cuda()
    drafter, weaver = (m.cuda() for m in make_drafters(target, mask_token_id=None))
    assert drafting.draft_head(target, next(drafter.parameters()).dtype).int8  # the default on CUDA
    for int8_layers in (False, True):  # then the drafter's own linears on int8 weights too (packed.int8_linears)
        if int8_layers:
            assert int8_linears(drafter) > 0
        for ids in prompts():
            ids = ids.cuda()
            expected = reference(target, ids, 48)
            for mode in MODES:
                for target_step in ("eager", "graph", "compiled"):
                    got = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode,
                                               tree_budget=12, max_new_tokens=48, target_step=target_step)
                    assert torch.equal(got, expected), (mode, target_step, int8_layers)


@pytest.mark.parametrize("mode", ["ddtree", "weaver"])
def test_compiled_steps_identity_on_gpu(mode):
    """target_step="compiled" (torch.compile'd tree pass and tree build inside CUDA graphs) on the hybrid target:
    AR and the loop token-identical to transformers; one drafter pair, so five compiles in all per mode (tree pass and
    commit of 1 and 13 nodes, the draft + tree build)."""
    from modeling_weaver.lab.benchmark import autoregressive_generate

    target = TINY_TARGETS["qwen3_5"]().cuda()
    drafter, weaver = (m.cuda() for m in make_drafters(target, mask_token_id=None))
    for ids in prompts():
        ids = ids.cuda()
        expected = reference(target, ids, 48)
        assert torch.equal(autoregressive_generate(target, ids, 48, target_step="compiled"), expected)
        got = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget=12,
                                   max_new_tokens=48, target_step="compiled")
        assert torch.equal(got, expected), mode


def test_graphs_are_captured_once_per_tree_size_across_prompt_lengths():
    from modeling_weaver.decoding.step_cache import _STATIC_TARGETS

    target = TINY_TARGETS["qwen3_5"]().cuda()
    drafter, weaver = (m.cuda() for m in make_drafters(target))
    graphs = []
    for length in (1, 9, 40, 3):
        ids = torch.randint(0, 97, (1, length), device="cuda")
        got = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode="ddtree", tree_budget=12,
                                   max_new_tokens=32, target_step="graph")
        assert torch.equal(got, reference(target, ids, 32)), length
        # greedy steps are fused ones (draft + tree, verify, accept, commit in one graph) from the first step on
        draft = next(v for k, v in _STATIC_TARGETS[drafter].items() if k[0] == "draft")
        graphs.append([step._graph[0] for key, step in draft._steps.items() if key[0] == "fused"])
    assert len(_STATIC_TARGETS[target]) == 1 and next(iter(_STATIC_TARGETS[target].values())).capture
    assert len(graphs[0]) == 1 and all(g[0] is graphs[0][0] for g in graphs)


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_auto_budget_in_graph_steps_on_gpu(name):
    """tree_budget="auto" with CUDA-graph steps: greedy ones are whole steps (draft and choice in one graph, then a
    graph per bucket), each captured once on first use and replayed by the next generation (another prompt length,
    the same capacity bucket); token-identical to AR; the split steps (sampling) capture a bucket per size."""
    from modeling_weaver import BudgetPolicy
    from modeling_weaver.decoding.budget import CostTable
    from modeling_weaver.decoding.step_cache import _STATIC_TARGETS

    target = TINY_TARGETS[name]().cuda()
    drafter, weaver = (m.cuda() for m in make_drafters(target))
    mixed = CostTable(((0, 10.0), (4, 11.0), (8, 12.0), (16, 14.0), (32, 18.0)), 2.0)
    graphs = []
    for length in (9, 40):
        ids = torch.randint(0, 97, (1, length), device="cuda")
        got, stats = speculative_generate(target, ids, drafter=drafter, weaver=weaver, tree_budget="auto",
                                          max_new_tokens=40, target_step="graph", return_stats=True,
                                          budget_policy=BudgetPolicy(costs=mixed))
        assert torch.equal(got, reference(target, ids, 40)), length
        draft = next(v for k, v in _STATIC_TARGETS[drafter].items() if k[0] == "draft")
        (steps,) = [v for k, v in draft._steps.items() if k[0] == "auto"]
        assert steps.capture and "choose" in steps._graphs and len(steps._graphs) >= 2, list(steps._graphs)
        graphs.append({key: entry[0] for key, entry in steps._graphs.items()})
        assert sum(stats.size_histogram.values()) == stats.num_steps
    assert all(graphs[1][key] is graph for key, graph in graphs[0].items())  # replayed, not captured again
    got = speculative_generate(target, ids, drafter=drafter, weaver=weaver, tree_budget="auto", max_new_tokens=24,
                               target_step="graph", budget_policy=BudgetPolicy(costs=mixed), do_sample=True,
                               generator=torch.Generator().manual_seed(0))
    buckets = next(v for k, v in _STATIC_TARGETS[target].items() if k[0] == "buckets")
    assert buckets.capture and buckets.captures >= 1 and all(step.captures == 1 for step in buckets.steps.values())


def test_graph_steps_allocate_nothing_per_step_and_capture_once():
    """After warm-up, a long graph-mode generation neither grows memory nor captures again (the fused step's graph —
    draft + tree, verify, accept and commit in one — stays the same object)."""
    from modeling_weaver.decoding.step_cache import _STATIC_TARGETS

    target = TINY_TARGETS["qwen3_5"]().cuda()
    drafter, weaver = (m.cuda() for m in make_drafters(target))
    ids = torch.randint(0, 97, (1, 20), device="cuda")
    kwargs = dict(drafter=drafter, weaver=weaver, mode="weaver", tree_budget=12, target_step="graph")
    speculative_generate(target, ids, max_new_tokens=1100, **kwargs)  # warm-up: captures (cache bucket 2048)
    torch.cuda.synchronize()
    def fused_graphs():  # greedy steps are fused ones from the first step on: their graph is the one to keep
        draft = next(v for k, v in _STATIC_TARGETS[drafter].items() if k[0] == "draft")
        return draft, [step._graph[0] for key, step in draft._steps.items() if key[0] == "fused"]

    draft, graphs = fused_graphs()
    before = torch.cuda.memory_allocated()
    speculative_generate(target, ids, max_new_tokens=1500, **kwargs)  # same bucket: same buffers and graphs
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 1 << 20  # per-call scratch only, no per-step growth
    draft_after, graphs_after = fused_graphs()
    assert draft.capture and draft_after is draft and len(graphs) == 1 and graphs_after == graphs


def test_stopping_rules_read_host_ids():
    """The fused steps run one step ahead of the host: emitting a token must not touch the device (a read or a copy
    would wait behind the step in flight), so stopping rules see CPU ids; the output is back on the prompt's device."""
    from transformers.generation import StoppingCriteria

    class Record(StoppingCriteria):
        def __init__(self):
            self.devices = set()

        def __call__(self, input_ids, scores, **kwargs):
            self.devices.add(input_ids.device.type)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    target = TINY_TARGETS["qwen3_5"]().cuda()
    drafter, weaver = (m.cuda() for m in make_drafters(target))
    ids = torch.randint(0, 97, (1, 12), device="cuda")
    record = Record()
    got, _ = _decode(
        target, ids[0], runner=DFlashRunner(drafter, target), weaver=weaver, mode="weaver", tree_budget=12,
        max_new_tokens=40, processors=LogitsProcessorList(), do_sample=False, verification=None,
        stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(ids.shape[1] + 40), record]), streamer=None,
        generator=None, target_step="graph",
    )
    assert record.devices == {"cpu"} and got.device == ids.device
    assert torch.equal(got, reference(target, ids, 40))


@pytest.mark.parametrize("target_step", ["graph", "compiled"])
def test_smollm2_size_identity_on_gpu(target_step):
    """A random-weight target at SmolLM2-135M-Instruct's shape (30 layers, hidden 576, vocab 49152) with random
    drafters of its hub spec, fp32: our AR and the loop token-identical to transformers with captured steps (every
    mode) and compiled ones (AR, Weaver: each compile costs tens of seconds at this size), at two prompt lengths;
    with an oracle drafter (long accepted paths), captured steps."""
    from modeling_weaver.lab.benchmark import autoregressive_generate
    from modeling_weaver.lab.replay import random_models

    target, drafter, weaver = random_models("smollm2-135m-instruct", torch.device("cuda"), torch.float32)
    gen = torch.Generator().manual_seed(3)
    modes = MODES if target_step == "graph" else ("weaver",)
    for length in (5, 40):
        ids = torch.randint(0, text_config(target.config).vocab_size, (1, length), generator=gen).cuda()
        expected = reference(target, ids, 40)
        assert torch.equal(autoregressive_generate(target, ids, 40, target_step=target_step), expected), length
        for mode in modes:
            got = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget=16,
                                       max_new_tokens=40, target_step=target_step)
            assert torch.equal(got, expected), (mode, length)
    if target_step == "graph":  # random drafters accept ~nothing: an oracle drafter commits deep paths too
        with torch.no_grad():  # Weaver then follows the planted marginals (as in test_generate)
            weaver.lm_head_query_in.weight.zero_()
        for mode in ("ddtree", "weaver"):
            got, stats = run_oracle(target, weaver, ids, mode, 24, 40, target_step="graph")
            assert torch.equal(got, reference(target, ids, 40)), (mode, "oracle")
            # (DDTree: 2.56 on CPU; 49152 tokens flatten the planted marginals)
            assert stats.mean_accepted_length > 2.0, mode

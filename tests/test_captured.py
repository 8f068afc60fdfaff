"""Fixed-shape steps (CUDA graphs on GPU; the same code eagerly on CPU) equal the dynamic ones."""

import pytest
import torch
from tiny_targets import TINY_TARGETS
from torch.utils._python_dispatch import TorchDispatchMode

from modeling_weaver import DFlashConfig, DFlashDraftModel
from modeling_weaver.decoding.drafting import StaticDraft, StaticProposer
from modeling_weaver.generate import DFlashRunner
from modeling_weaver.options import StepOptions
from modeling_weaver.target import text_config


def rel(a, b):
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm().clamp_min(1e-12))


@pytest.mark.parametrize("layers", ["full", "sliding", "sliding_bidirectional"])
def test_static_draft_equals_the_dynamic_runner(layers, monkeypatch):
    """Over many steps (a long first context, then accepted paths of 1..block tokens), the static drafter gives the
    dynamic runner's hidden states and logits — also with sliding-window layers causal inside the block (a window
    shorter than the block), which attend through ``weaver_kernels.tree_attention`` like full layers, and with a
    window shorter than a bidirectional block, which the cache leaves to masked SDPA."""
    import weaver_kernels

    try:  # the Triton kernel itself on Triton's CPU interpreter (strided queries, grouped heads, the lead's length)
        from weaver_kernels.utils import load_interpreted

        kernel = load_interpreted("weaver_kernels.tree_attention.split").tree_attention_triton
        attention = lambda q, k, v, m, n, bound, scale, window: kernel(q, k, v, m, n, bound, scale,  # noqa: E731
                                                                         window=window)
    except ImportError:  # no Triton: the op's reference
        attention = weaver_kernels.tree_attention
    calls = []
    monkeypatch.setattr(weaver_kernels, "tree_attention", lambda *a: calls.append(a[-1]) or attention(*a))
    target = TINY_TARGETS["llama"]()
    extra = {} if layers == "full" else dict(layer_types=["sliding_attention", "full_attention"],
                                              use_sliding_window=True, sliding_window=6, max_window_layers=0)
    if layers == "sliding_bidirectional":
        extra["is_causal"] = False
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
    # windows per kernel call: both layers (the prompt's lead call too) or only the full one
    assert set(calls) == {0} if layers != "sliding" else set(calls) == {0, 6}
    assert len(calls) == 9 * (1 if layers == "sliding_bidirectional" else 2)
    with pytest.raises(ValueError, match="beyond"):
        static.draft(0, torch.randn(1, width), 130)


@pytest.mark.parametrize("node_table", [True, False])
def test_eager_proposer_keeps_the_node_table_of_its_weaver(node_table):
    """Eager Weaver proposers gather node inputs from the Weaver's node-input table (``StepOptions.node_table``):
    one table per Weaver, shared by every proposer and generation, made again when the Weaver's input
    layers change in place; the tree is the one built with node inputs computed each round."""
    from test_generate import make_drafters

    from modeling_weaver.decoding.drafting import EagerProposer, node_table_of
    from modeling_weaver.tree import tree_drafts

    target = TINY_TARGETS["llama"]()
    drafter, weaver = make_drafters(target)
    options = StepOptions(node_table=node_table)
    first, second = (EagerProposer(DFlashRunner(drafter, target, options), "weaver", 8, weaver, target)
                     for _ in range(2))
    assert (first.node_table is not None) == node_table
    if not node_table:
        return
    embed = target.get_input_embeddings().weight
    assert second.node_table is first.node_table
    assert rel(first.node_table[5:50:9], weaver.node_inputs(embed[5:50:9])) < 1e-6
    with torch.no_grad():
        weaver.token_in.weight.mul_(0.5)
    table = node_table_of(weaver, embed)
    assert table is not first.node_table and rel(table[5:50:9], weaver.node_inputs(embed[5:50:9])) < 1e-6
    gen = torch.Generator().manual_seed(3)
    size = target.config.hidden_size
    hidden, logits = torch.randn(15, size, generator=gen), 3 * torch.randn(15, embed.shape[0], generator=gen)
    args = ("weaver", 7, hidden, logits, 8, weaver, torch.randn(size, generator=gen), target.get_input_embeddings(),
            target.lm_head.weight)
    with torch.no_grad():
        gathered, computed = tree_drafts(*args, node_table=table), tree_drafts(*args)
    assert torch.equal(gathered[0], computed[0]) and torch.equal(gathered[1], computed[1])
    assert rel(gathered[2], computed[2]) < 1e-4


@pytest.mark.parametrize("mode,node_table", [("chain", False), ("ddtree", False), ("weaver", False), ("weaver", True)])
def test_static_proposer_gives_the_eager_draft_and_tree(mode, node_table, monkeypatch):
    """The fixed-shape proposer gives the eager draft and tree; Weaver trees with node inputs computed each round
    and gathered from the Weaver's node-input table alike."""
    from test_generate import make_drafters

    from modeling_weaver.tree import chain_tree, ddtree, weaver_tree

    from modeling_weaver.options import StepOptions

    target = TINY_TARGETS["qwen3_5"]()
    drafter, weaver = make_drafters(target)
    hidden_size = text_config(target.config).hidden_size
    width = len(drafter.config.target_layer_ids) * hidden_size
    dynamic = DFlashRunner(drafter, target)
    static = StaticDraft(drafter, target, max_length=96, capture=False, options=StepOptions(node_table=node_table))
    proposer = static.proposer(mode, 10, weaver)
    assert (proposer.node_table is not None) == node_table
    if node_table:  # row t = node_inputs(E[t]); one table per Weaver, shared by its proposers
        assert static.proposer(mode, 6, weaver).node_table is proposer.node_table
        embed = target.get_input_embeddings().weight
        assert proposer.node_table.shape == (embed.shape[0], weaver.config.d_rank)
        assert rel(proposer.node_table[3:40:7], weaver.node_inputs(embed[3:40:7])) < 1e-6
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

    from modeling_weaver.decoding.step_cache import static_draft
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
    assert set(stats.phase_ms) == {"step"} and len(timer.spans["step"]) == stats.num_steps  # all fused, the first too
    assert max(stats.accepted_lengths) >= 6 and stats.mean_accepted_length > 2.5, stats.accepted_lengths


class CaptureRules(TorchDispatchMode):
    """What a CUDA graph capture refuses, seen on CPU: reading a tensor on the host (``.item()``, ``int(t)``, indexing
    with a 0-d tensor) and storing host data into a tensor (``torch.tensor(...)``, ``x[i] = 0.0``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.lift_fresh.default):
            raise RuntimeError(f"{func} inside a captured step: a CUDA graph capture would fail here")
        return func(*args, **(kwargs or {}))


class FakeGraph:
    """CPU stand-in for a CUDA graph with its semantics: outputs live in fixed tensors, a replay recomputes from the
    static inputs and overwrites them in place (so code that reads anything but those tensors, or that relies on
    Python state set at capture time, goes wrong here as it would on the GPU); capture and replays run under
    :class:`CaptureRules`."""

    def __init__(self, fn):
        self.fn = fn
        self.replays = 0

    def replay(self):
        self.replays += 1
        with CaptureRules():
            copy_into(self.out, self.fn())

    def pool(self):
        return None


def copy_into(dst, src):
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            copy_into(d, s)
    elif hasattr(dst, "__dataclass_fields__"):
        for name in dst.__dataclass_fields__:
            copy_into(getattr(dst, name), getattr(src, name))


def fake_capture_graph(fn, pool=None, warmup: int = 2, restore=()):
    saved = [x.clone() for x in restore]
    for _ in range(warmup):
        fn()
    graph = FakeGraph(fn)
    with CaptureRules():
        graph.out = fn()  # a real capture records without running: the restore below undoes this run too
    for x, y in zip(restore, saved):
        x.copy_(y)
    return graph, graph.out


@pytest.fixture
def fake_graphs(monkeypatch):
    """Run every 'captured' path on CPU through FakeGraph."""
    import sys

    import modeling_weaver.decoding.graphs as graphs
    import modeling_weaver.decoding.loop as loop
    import modeling_weaver.decoding.step_cache as step_cache
    import modeling_weaver.lab.benchmark  # noqa: F401
    import modeling_weaver.lab.replay  # noqa: F401

    # sys.modules: the package's `generate` attribute is the function, not the module
    generate, benchmark, replay = (sys.modules[f"modeling_weaver.{m}"] for m in ("generate", "lab.benchmark",
                                                                                  "lab.replay"))

    monkeypatch.setattr(graphs, "capture_graph", fake_capture_graph)
    real_target, real_draft = step_cache.static_target, step_cache.static_draft

    def forced_target(model, max_length, num_nodes, feature_layer_ids=(), capture=None, compile=False,
                      max_tree_depth=None, **options):
        return real_target(model, max_length, num_nodes, feature_layer_ids, capture=True, compile=compile,
                           max_tree_depth=max_tree_depth, **options)

    def forced_draft(drafter, target, max_length, capture=None, **options):
        return real_draft(drafter, target, max_length, capture=True, **options)

    for module in (loop, generate, benchmark, replay):
        if hasattr(module, "static_target"):
            monkeypatch.setattr(module, "static_target", forced_target)
        if hasattr(module, "static_draft"):
            monkeypatch.setattr(module, "static_draft", forced_draft)
    yield
    step_cache._STATIC_TARGETS.clear()


@pytest.mark.parametrize("name", list(TINY_TARGETS))
def test_graph_semantics_keep_the_loop_exact(fake_graphs, name):
    """With graph semantics (fixed outputs, replays), AR and the loop in every mode stay token-identical, several
    prompt lengths share one set of captures, and the captured steps are the ones that run."""
    from test_generate import make_drafters, prompts, reference

    from modeling_weaver import speculative_generate
    from modeling_weaver.lab.benchmark import autoregressive_generate
    from modeling_weaver.decoding.step_cache import _STATIC_TARGETS

    target = TINY_TARGETS[name]()
    drafter, weaver = make_drafters(target, mask_token_id=None if name == "qwen3_5" else 96)
    for ids in prompts():
        expected = reference(target, ids, 40)
        assert torch.equal(autoregressive_generate(target, ids, 40, target_step="graph"), expected)
        for mode in ("chain", "ddtree", "weaver"):
            got = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget=10,
                                       max_new_tokens=40, target_step="graph")
            assert torch.equal(got, expected), (name, mode, ids.shape)
    steps = [s for s in _STATIC_TARGETS[target].values()]
    assert {s.num_nodes for s in steps} == {1, 11}, [(s.num_nodes, s.capture, s.captures) for s in steps]
    (ar,), (tree,) = ([s for s in steps if s.num_nodes == n] for n in (1, 11))
    assert tree.capture and tree.captures == 0  # every step fused, the first too: no separate verify/commit graphs
    assert ar.capture and ar.captures == 0 and ar._ar._graph[0].replays > 0  # AR: its fused step's graph only
    draft = next(v for k, v in _STATIC_TARGETS[drafter].items() if k[0] == "draft")
    fused = [v for k, v in draft._steps.items() if k[0] == "fused"]
    assert len(fused) == 3 and all(f._graph is not None and f._graph[0].replays > 0 for f in fused)


def test_compiled_tree_steps_are_exact_and_compile_once_per_tree_size():
    """target_step="compiled": the target's tree pass and commit and the Weaver draft + tree build run torch.compile'd (whole graphs,
    static shapes), AR and fused Weaver steps stay token-identical, and a second prompt of another length compiles
    nothing new."""
    from test_generate import make_drafters, reference
    from torch._dynamo.utils import counters

    from modeling_weaver import speculative_generate
    from modeling_weaver.lab.benchmark import autoregressive_generate

    torch._dynamo.reset()  # clears dynamo's caches, not its counters (other tests in this process may have moved them)
    before = counters["stats"]["unique_graphs"]
    target = TINY_TARGETS["qwen3_5"]()
    drafter, weaver = make_drafters(target, mask_token_id=None)
    graphs = []
    for length in (7, 19):
        ids = torch.randint(0, 90, (1, length), generator=torch.Generator().manual_seed(length))
        expected = reference(target, ids, 24)
        assert torch.equal(autoregressive_generate(target, ids, 24, target_step="compiled"), expected)
        got = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode="weaver", tree_budget=8,
                                   max_new_tokens=24, target_step="compiled")
        assert torch.equal(got, expected), length
        graphs.append(counters["stats"]["unique_graphs"] - before)
    # the AR token step, the 9-node tree pass and its commit, the Weaver draft + tree build; nothing more for the
    # second prompt
    assert graphs[0] == 4 and graphs[1] == graphs[0], graphs


def test_compiled_and_plain_proposers_keep_their_own_graphs(monkeypatch):
    """A compiled proposer and a plain one of the same mode and budget never share a captured graph, and compiled
    steps may compile more than dynamo's default 8 times per code object (buckets × tree sizes, modes × budgets)."""
    from test_generate import make_drafters

    import modeling_weaver.decoding.graphs as graphs
    from modeling_weaver.decoding.step_cache import static_draft
    from modeling_weaver.target import compile_static

    def capture_without_rules(fn, pool=None, warmup=2, restore=()):  # CaptureRules' dispatch mode stops dynamo
        graph = FakeGraph(fn)
        graph.out = fn()
        graph.replay = lambda: copy_into(graph.out, fn())
        return graph, graph.out

    monkeypatch.setattr(graphs, "capture_graph", capture_without_rules)
    target = TINY_TARGETS["llama"]()
    drafter, _ = make_drafters(target, mask_token_id=96)
    # (the fp32 head: a CPU's default int8 head is fbgemm's GEMM, which compiled steps replace by the reference)
    draft = static_draft(drafter, target, 64, capture=True, options=StepOptions(int8_head=False))
    context = torch.randn(5, drafter.fc.in_features)
    trees = [draft.proposer("ddtree", 8, compile=c).propose(3, context, 5, torch.zeros(drafter.config.hidden_size))[2]
             for c in (False, True)]
    assert len(draft._graphs) == 2
    assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(trees[0].parents, trees[1].parents)
    compile_static(lambda x: x)
    assert torch._dynamo.config.recompile_limit >= 64


def test_graph_semantics_fused_steps_with_deep_acceptance(fake_graphs):
    for name in ("llama", "qwen3_5"):
        for mode in ("chain", "weaver"):
            test_fused_greedy_steps_are_exact_with_deep_acceptance(name, mode)


def test_graph_semantics_pipelined_fused_steps(fake_graphs):
    """Captured fused steps run one step ahead of the host, never past a step that may end the output by length;
    the output is still exactly greedy decoding, and a veto (``ahead``) keeps launches and reads in step."""
    from test_generate import make_drafters, reference

    from modeling_weaver import speculative_generate
    from modeling_weaver.decoding.step_cache import _STATIC_TARGETS

    target = TINY_TARGETS["qwen3_5"]()
    drafter, weaver = make_drafters(target, mask_token_id=None)
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(2))
    got, stats = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode="ddtree", tree_budget=8,
                                      max_new_tokens=40, target_step="graph", return_stats=True)
    assert torch.equal(got, reference(target, ids, 40))
    (draft,) = (v for k, v in _STATIC_TARGETS[drafter].items() if k[0] == "draft")
    (fused,) = (v for k, v in draft._steps.items() if k[0] == "fused")
    launched, read = fused._graph[0].replays, stats.num_steps  # every step fused, the first too
    # ended by length: nothing was launched past the last step (the one in flight could have ended the output)
    assert got.shape[1] - ids.shape[1] == 40 and read > 3 and launched == read, (launched, read)

    leads, read_step = [], fused._read  # a second generation (same graphs): how far launches run ahead of reads

    def watched(launched_step):
        leads.append(fused._graph[0].replays - start - len(leads))
        return read_step(launched_step)

    fused._read, start = watched, fused._graph[0].replays
    assert torch.equal(speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode="ddtree", tree_budget=8,
                                            max_new_tokens=40, target_step="graph"), got)
    del fused._read
    assert max(leads) == 2 and set(leads) <= {1, 2}, leads  # the step being read, and one more in flight

    # our AR path runs its own fused step, pipelined as well: it stops at an end token as transformers does
    from modeling_weaver.lab.benchmark import autoregressive_generate

    ref = reference(target, ids, 40)[0, ids.shape[1]:].tolist()
    eos = ref[4]
    ar = autoregressive_generate(target, ids, 40, eos_token_id=eos, target_step="graph")[0, ids.shape[1]:].tolist()
    assert ar == ref[: ref.index(eos) + 1]

    fused.arm(*_prefilled(fused))
    before = fused._graph[0].replays
    steps = fused.run(ahead=lambda: False)
    outputs = [next(steps) for _ in range(3)]
    steps.close()
    assert fused._graph[0].replays - before == 3 and all(len(tokens) >= 1 for tokens, _ in outputs)


def _prefilled(fused):
    """Prefill a short prompt on the fused step's target: what ``arm`` takes (bonus, context, last hidden)."""
    fused.target.adapter.reset()
    verified = fused.target.prefill(torch.arange(3, 9))
    return int(verified.logits[-1].argmax()), verified.features, verified.hidden[-1]


def test_graph_semantics_sampler(fake_graphs):
    from test_sampler import EOS, hf_greedy

    from modeling_weaver.lab.sampler import BatchedSampler

    model = TINY_TARGETS["qwen3"]()
    sampler = BatchedSampler(model, batch_size=4, max_length=64, capture=True)
    gen = torch.Generator().manual_seed(4)
    for lengths in [(3, 9, 5), (1, 12, 2, 8)]:
        prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in lengths]
        got = sampler.generate(prompts, 24, eos_token_id=EOS)
        for (tokens, _), ref in zip(got, hf_greedy(model, prompts, 24)):
            assert tokens == ref[: len(tokens)]
    assert sampler.capture and sampler._graph.replays > 0


def test_graph_semantics_replay(fake_graphs):
    """The acceptance replay with captured fused steps follows its trace as the host rule does."""
    from modeling_weaver.lab.replay import ReplayedAcceptance, random_models, replay_generate

    target, drafter, weaver = random_models("tiny", torch.device("cpu"), torch.float32)
    ids = torch.zeros(1, 5, dtype=torch.long)
    for mode in ("chain", "ddtree", "weaver"):
        acceptance = ReplayedAcceptance([3, 1, 5])
        for _ in range(2):  # the second generation replays the same captures
            _, stats = replay_generate(target, drafter, weaver, ids, mode, 8, acceptance, 60, target_step="graph")
            assert stats.accepted_lengths[:6] == [3, 1, 5, 3, 1, 5], mode
            assert "step" in stats.phase_ms


def test_complete_output_arms_no_fused_step(monkeypatch):
    """A generation complete after the prefill's token (max_new_tokens=1) runs no drafter pass over the prompt."""
    from test_generate import make_drafters, reference

    from modeling_weaver import speculative_generate
    from modeling_weaver.decoding.drafting import StaticDraft, StaticProposer

    target = TINY_TARGETS["llama"]()
    drafter, weaver = make_drafters(target, mask_token_id=96)
    ids = torch.randint(0, 90, (1, 20), generator=torch.Generator().manual_seed(1))
    loads = []
    monkeypatch.setattr(StaticDraft, "load", lambda self, *a: loads.append(a))
    got = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode="ddtree", tree_budget=6,
                               max_new_tokens=1, target_step="static")
    assert torch.equal(got, reference(target, ids, 1)) and loads == []


def test_graph_semantics_fused_auto_steps(fake_graphs):
    """tree_budget="auto" as whole steps under graph semantics: the draft-and-choose graph and each bucket's graph
    read nothing on the host inside (CaptureRules), replay into their fixed outputs, and decoding stays exactly
    greedy, with AR steps that skip drafting (a steep cost table) and trees of several sizes (a flat one)."""
    from test_auto_budget import FLAT, STEEP
    from test_generate import make_drafters, reference

    from modeling_weaver import BudgetPolicy, speculative_generate
    from modeling_weaver.decoding.step_cache import _STATIC_TARGETS

    target = TINY_TARGETS["qwen3_5"]()
    drafter, weaver = make_drafters(target, mask_token_id=None)
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(2))
    before: dict = {}
    for costs in (FLAT, STEEP):
        got, stats = speculative_generate(target, ids, drafter=drafter, weaver=weaver, tree_budget="auto",
                                          max_new_tokens=40, target_step="graph", return_stats=True,
                                          budget_policy=BudgetPolicy(costs=costs, max_size=32))
        assert torch.equal(got, reference(target, ids, 40)), costs
        (draft,) = (v for k, v in _STATIC_TARGETS[drafter].items() if k[0] == "draft")
        (auto,) = (v for k, v in draft._steps.items() if k[0] == "auto")
        replays = {key: entry[0].replays - before.get(key, 0) for key, entry in auto._graphs.items()}
        before = {key: entry[0].replays for key, entry in auto._graphs.items()}  # (later generations replay them)
        drafts = replays.pop("choose")
        assert drafts > 0 and sum(replays.values()) == stats.num_steps, replays  # a bucket's graph per step
        if costs is STEEP:  # AR steps that skipped drafting
            assert drafts < stats.num_steps and stats.size_histogram.get(0, 0) > 0, (drafts, stats.size_histogram)

"""Acceptance replay (issue 5): the loop at a real shape with accepted lengths from a trace; CPU smoke at tiny shape."""

import json
import time

import pytest
import torch

from modeling_weaver.lab.benchmark import autoregressive_generate
from modeling_weaver.lab.replay import (
    FirstTokenClock,
    ReplayedAcceptance,
    PeakPlanter,
    load_traces,
    mixed_trace,
    random_models,
    replay_generate,
    run_replay_suite,
    synthetic_trace,
    token_weight_bytes,
)
from modeling_weaver.tree import Tree


def test_synthetic_trace_has_the_asked_mean_and_range():
    for mal in (4.0, 7.1, 12.0):  # the paper's 7.1 at block 16: the cap would pull a plain geometric to 6.5
        trace = synthetic_trace(mal, max_length=16, num_steps=20000, seed=1)
        assert min(trace) >= 1 and max(trace) <= 16
        assert abs(sum(trace) / len(trace) - mal) < 0.1, (mal, sum(trace) / len(trace))
    assert synthetic_trace(16.0, 16, 5) == [16] * 5
    assert synthetic_trace(1.0, 8, 10) == [1] * 10
    with pytest.raises(ValueError, match="MAL"):
        synthetic_trace(20.0, max_length=16)


def test_mixed_trace_alternates_easy_and_hard_runs_with_their_confidence():
    trace, tops = mixed_trace(7.1, 1.1, segment=16, max_length=16, num_steps=32000, seed=3)
    assert len(trace) == len(tops) == 32000
    easy = [n for s, n in enumerate(trace) if (s // 16) % 2 == 0]
    hard = [n for s, n in enumerate(trace) if (s // 16) % 2 == 1]
    assert abs(sum(easy) / len(easy) - 7.1) < 0.15 and abs(sum(hard) / len(hard) - 1.1) < 0.02
    assert tops[:16] == [0.8] * 16 and tops[16:32] == pytest.approx([0.1] * 16) and tops[32] == 0.8
    for bad in ({"hard_mal": 1.0}, {"hard_mal": 8.0}, {"segment": 0}):
        with pytest.raises(ValueError, match="mixed set"):
            mixed_trace(**{"mal": 7.1, "hard_mal": 1.1, "segment": 16, "max_length": 16, **bad})


def test_planted_peaks_follow_the_step_of_a_mixed_set():
    step = torch.zeros((), dtype=torch.long)
    planter = PeakPlanter(decay=0.5, tops=torch.tensor([0.8, 0.1, 0.3]), step=step)
    logits = torch.randn(3, 4000) * 0.1  # (no other token near the smallest peak)
    for s, top in enumerate([0.8, 0.1, 0.3, 0.8]):
        step.fill_(s)
        probs = planter(logits).softmax(-1).max(-1).values
        assert probs.tolist() == pytest.approx([top, top * 0.5, top * 0.25], rel=1e-4), s
    with pytest.raises(ValueError, match="step counter"):
        PeakPlanter(tops=torch.tensor([0.5]))
    accept = ReplayedAcceptance([2, 1], tops=[0.8, 0.1])
    assert accept.planter.step is accept.step  # the acceptance's own counter drives its planter
    with pytest.raises(ValueError, match="one planted peak per traced step"):
        ReplayedAcceptance([2, 1, 3], tops=[0.8, 0.1])


def test_replayed_acceptance_takes_the_most_probable_path_of_the_traced_length():
    #        0
    #      /   \
    #     1     2        logq: 1 → -0.1, 2 → -2.0
    #    / \     \
    #   3   4     5      logq: 3 → -1.5, 4 → -0.2, 5 → -0.01
    tree = Tree.from_lists([9, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 2], [0, -0.1, -2.0, -1.5, -0.2, -0.01])
    scores = torch.zeros(6, 11)
    scores[4, 7] = 1.0
    accept = ReplayedAcceptance([3, 2, 10])
    first = accept(tree, scores)
    assert first.path == [0, 1, 4] and first.bonus == 7
    assert accept(tree, scores).path == [0, 1]
    assert len(accept(tree, scores).path) == 3  # deeper than the tree: its deepest most probable path


def test_replay_suite_runs_every_phase_at_tiny_shape():
    target, drafter, weaver = random_models("tiny", torch.device("cpu"), torch.float32)
    traces = {(m, 8): synthetic_trace(mal, drafter.block_size, seed=0) for m, mal in
              (("chain", 3.0), ("ddtree", 3.5), ("weaver", 4.0))}
    rows = run_replay_suite(target, drafter, weaver, traces, ["chain", "ddtree", "weaver"], [8], prompt_len=12,
                            max_new_tokens=40, target_step="static", hf_tokens=6, split=True)
    assert [r["method"] for r in rows] == ["ar", "hf eager"] + [f"{m}@8{s}" for m in ("chain", "ddtree", "weaver")
                                                                for s in ("", " split")]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    for row in rows[2:]:
        assert row["mal"] > 1.5  # planted peaks give the trees enough depth for the traced lengths
        if row["method"].endswith("split"):  # unfused static steps: every phase timed
            assert all(row[f"{p}_ms"] > 0 for p in ("draft+tree", "verify", "accept", "commit"))
        else:  # fused from the first step on: one span per step
            assert row["step_ms"] > 0 and "verify_ms" not in row
        assert "tree_ms" not in row
    _, stats = replay_generate(target, drafter, weaver, torch.zeros(1, 5, dtype=torch.long), "chain", 8,
                               ReplayedAcceptance([3, 1, 5]), max_new_tokens=60, target_step="eager")
    assert stats.accepted_lengths[:6] == [3, 1, 5, 3, 1, 5]  # a chain always holds the traced depth
    for step in ("static", "eager"):  # fused device steps replay the same trace as the host rule
        _, fused = replay_generate(target, drafter, weaver, torch.zeros(1, 5, dtype=torch.long), "weaver", 8,
                                   ReplayedAcceptance([3, 1, 5]), max_new_tokens=60, target_step=step)
        assert fused.accepted_lengths[:6] == [3, 1, 5, 3, 1, 5], step
        assert ("step" in fused.phase_ms) == (step == "static")


@pytest.mark.parametrize("target_step", ["eager", "static"])
def test_replay_auto_chooses_each_size_from_the_costs(monkeypatch, target_step):
    """tree_budget="auto" in the replay (issue 29): free drafting and a flat verify cost keep the largest tree, which
    replays the trace as the fixed budget does; a costly draft and verify make every step an AR step."""
    import modeling_weaver.lab.replay as replay
    from modeling_weaver.decoding.budget import CostTable

    target, drafter, weaver = random_models("tiny", torch.device("cpu"), torch.float32)
    ids = torch.zeros(1, 5, dtype=torch.long)
    seen = []

    def costs(table):
        return lambda *args: (seen.append(args[3:5]), table)[1]

    monkeypatch.setattr(replay, "step_costs", costs(CostTable(((0, 10.0), (4, 10.0), (8, 10.0)), 0.0)))
    _, fixed = replay_generate(target, drafter, weaver, ids, "chain", 8, ReplayedAcceptance([3, 1, 5]),
                               max_new_tokens=40, target_step=target_step)
    _, auto = replay_generate(target, drafter, weaver, ids, "chain", "auto", ReplayedAcceptance([3, 1, 5]),
                              max_new_tokens=40, target_step=target_step)
    assert seen == [("chain", (0, 4, 8))]  # the CPU's candidate sizes, measured for the mode that runs
    assert auto.accepted_lengths == fixed.accepted_lengths and auto.accepted_lengths[:6] == [3, 1, 5, 3, 1, 5]
    # every step verifies the whole chain: one node per depth of the block (after the bonus)
    assert set(auto.size_histogram) == {min(8, drafter.block_size - 1)}
    assert auto.calibration["costs"]["propose_ms"] == 0.0
    monkeypatch.setattr(replay, "step_costs", costs(CostTable(((0, 1.0), (4, 1000.0), (8, 1000.0)), 1000.0)))
    _, costly = replay_generate(target, drafter, weaver, ids, "chain", "auto", ReplayedAcceptance([3, 1, 5]),
                                max_new_tokens=40, target_step=target_step)
    assert costly.mean_accepted_length == 1.0 and set(costly.size_histogram) == {0}


@pytest.mark.parametrize("target_step", ["eager", "static"])
def test_replay_auto_follows_a_mixed_set(monkeypatch, target_step):
    """On a mixed set auto verifies trees on the easy runs and takes AR steps on the hard ones (costly drafts, low
    planted confidence), which a fixed budget cannot; a flat mix (hard runs as confident as the easy ones) keeps
    drafting."""
    import modeling_weaver.lab.replay as replay
    from modeling_weaver.decoding.budget import CostTable

    monkeypatch.setattr(replay, "step_costs", lambda *args: CostTable(((0, 10.0), (4, 10.5), (8, 11.0)), 4.0))
    target, drafter, weaver = random_models("tiny", torch.device("cpu"), torch.float32)
    ids = torch.zeros(1, 5, dtype=torch.long)
    trace, tops = mixed_trace(drafter.block_size - 1, 1.05, 16, drafter.block_size, num_steps=512)
    _, stats = replay_generate(target, drafter, weaver, ids, "ddtree", "auto", ReplayedAcceptance(trace, tops=tops),
                               max_new_tokens=200, target_step=target_step)
    sizes = stats.tree_sizes
    hard_steps = [n for s, n in enumerate(sizes) if (s // 16) % 2 == 1]
    easy_steps = [n for s, n in enumerate(sizes) if (s // 16) % 2 == 0]
    # a hard run: a few drafting steps until AR has won skip_after times, then AR steps with growing backoff
    assert hard_steps and sum(n == 1 for n in hard_steps) > 0.5 * len(hard_steps), sizes
    assert sum(n > 1 for n in easy_steps) > 0.8 * len(easy_steps), sizes
    _, flat = replay_generate(target, drafter, weaver, ids, "ddtree", "auto",
                              ReplayedAcceptance(trace, tops=[0.8] * len(trace)), max_new_tokens=200,
                              target_step=target_step)
    assert sum(n == 1 for n in flat.tree_sizes) < 0.2 * len(flat.tree_sizes), flat.tree_sizes


def test_replay_suite_has_an_auto_row_with_its_sizes(monkeypatch):
    import modeling_weaver.lab.replay as replay
    from modeling_weaver.decoding.budget import CostTable

    monkeypatch.setattr(replay, "step_costs", lambda *args: CostTable(((0, 10.0), (8, 12.0)), 1.0))
    target, drafter, weaver = random_models("tiny", torch.device("cpu"), torch.float32)
    mals = replay._parse_mal(["ddtree=3.5"], ["ddtree"], [8, "auto"])
    assert mals == {("ddtree", 8): 3.5, ("ddtree", "auto"): 3.5}
    traces = {k: synthetic_trace(v, drafter.block_size, seed=0) for k, v in mals.items()}
    rows = run_replay_suite(target, drafter, weaver, traces, ["ddtree"], [8, "auto"], prompt_len=12,
                            max_new_tokens=24, target_step="eager")
    auto = rows[-1]
    assert auto["method"] == "ddtree@auto" and auto["budget"] == "auto" and auto["tokens_per_s"] > 0
    assert sum(auto["sizes"].values()) > 0 and auto["calibration"]["sizes"]
    json.dumps(rows)  # (what replay.json holds)
    assert "sizes" not in rows[-2]


def test_traces_come_from_bench_results(tmp_path):
    rows = [
        {"mode": "ar", "budget": None, "temperature": 0.0, "per_prompt": [{"accepted_lengths": []}]},
        {"mode": "weaver", "budget": 64, "temperature": 0.0,
         "per_prompt": [{"accepted_lengths": [3, 4]}, {"accepted_lengths": [1]}]},
        {"mode": "weaver", "budget": 64, "temperature": 1.0, "per_prompt": [{"accepted_lengths": [9]}]},
    ]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"rows": rows}))
    assert load_traces(path) == {("weaver", 64): [3, 4, 1]}
    path.write_text(json.dumps({"rows": rows[:1]}))
    with pytest.raises(ValueError, match="no greedy tree rows"):
        load_traces(path)


def test_replay_suite_leaves_the_prefill_out_of_every_decode_rate(monkeypatch):
    """A slow prefill (0.6 s more per call) shows in the AR row's prefill time and in no method's decode time."""
    from modeling_weaver.target import TargetAdapter

    prefill = TargetAdapter.prefill

    def slow(self, *args, **kwargs):
        time.sleep(0.6)
        return prefill(self, *args, **kwargs)

    monkeypatch.setattr(TargetAdapter, "prefill", slow)
    target, drafter, weaver = random_models("tiny", torch.device("cpu"), torch.float32)
    traces = {("weaver", 8): synthetic_trace(4.0, drafter.block_size, seed=0)}
    rows = run_replay_suite(target, drafter, weaver, traces, ["weaver"], [8], prompt_len=12, max_new_tokens=24,
                            target_step="static")
    assert rows[0]["prefill_s"] >= 0.6
    for row in rows:  # decode seconds: tokens after the first over the rate
        assert 0 < 23 / row["tokens_per_s"] < 0.6, row


@pytest.mark.parametrize("target_step", ["eager", "static"])
def test_decode_time_starts_at_the_first_new_token(target_step):
    """The replay's decode rates count from the first new token on the host, in the same run: the streamers see the
    prompt (AR) and then each token as it is emitted."""
    target, drafter, weaver = random_models("tiny", torch.device("cpu"), torch.float32)
    ids = torch.randint(0, 50, (1, 9), generator=torch.Generator().manual_seed(0))

    class Record(FirstTokenClock):
        def __init__(self, prompt_puts):
            super().__init__(prompt_puts)
            self.values, self.ended = [], False

        def put(self, value):
            super().put(value)
            self.values.append(value.flatten().tolist())

        def end(self):
            self.ended = True

    clock = Record(prompt_puts=1)
    start = time.perf_counter()
    out = autoregressive_generate(target, ids, 10, eos_token_id=[], target_step=target_step, streamer=clock)
    assert clock.values[0] == ids[0].tolist() and sum(clock.values[1:], []) == out[0, 9:].tolist() and clock.ended
    assert start < clock.first_token < time.perf_counter()
    clock = Record(prompt_puts=0)
    out, _ = replay_generate(target, drafter, weaver, ids, "weaver", 8, ReplayedAcceptance([3, 1, 5]), 20,
                             target_step, streamer=clock)
    assert sum(clock.values, []) == out[0, 9:].tolist() and clock.first_token is not None


def test_ab_setting_holds_inside_the_block_on_fresh_steps():
    """The A/B helper of the replay scripts: the setting holds inside the block only (the settings it yields; the
    ones given are left as they were), and the cached steps of the drafter and target (built under the other
    setting) are dropped on the way in and out, also when the block raises."""
    from modeling_weaver.decoding.step_cache import _STATIC_TARGETS
    from modeling_weaver.lab.replay import ab_setting
    from modeling_weaver.options import StepOptions, TreePolicy

    drafter, target = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    policy, options = TreePolicy(), StepOptions()
    _STATIC_TARGETS[target], _STATIC_TARGETS[drafter] = {"stale": object()}, {"stale": object()}
    setting, _ = ab_setting("peel_root", False, drafter, target, policy, options)
    with setting as (inside_policy, inside_options):
        assert inside_options == StepOptions(peel_root=False) and inside_policy == policy
        assert target not in _STATIC_TARGETS and drafter not in _STATIC_TARGETS
        _STATIC_TARGETS[target] = {"built inside": object()}
    assert options.peel_root is True and target not in _STATIC_TARGETS
    _STATIC_TARGETS[target] = {"stale": object()}
    with pytest.raises(RuntimeError), ab_setting("peel_root", False, drafter, target)[0]:
        raise RuntimeError
    assert target not in _STATIC_TARGETS


def test_int8_drafter_routes_the_drafters_linears_inside_the_block_only(tmp_path):
    """replay.int8_drafter (the scripts' A/B) puts the drafter's linears on int8 weights inside the block, on fresh
    steps, and restores them; `weaver replay --int8-drafter` runs the suite with them and says so."""
    from modeling_weaver.decoding.step_cache import _STATIC_TARGETS
    from modeling_weaver.cli import main
    from modeling_weaver.packed import _INT8
    from modeling_weaver.lab.replay import int8_drafter

    drafter, target = torch.nn.Sequential(torch.nn.Linear(16, 16)), torch.nn.Linear(2, 2)
    _STATIC_TARGETS[drafter], _STATIC_TARGETS[target] = {"stale": object()}, {"stale": object()}
    with int8_drafter(drafter, target):
        assert hasattr(drafter[0], _INT8) and drafter not in _STATIC_TARGETS and target not in _STATIC_TARGETS
    assert not hasattr(drafter[0], _INT8) and "forward" not in drafter[0].__dict__
    assert main(["replay", "--shape", "tiny", "--synthetic-mal", "weaver=3", "--modes", "weaver", "--budgets", "8",
                 "--prompt-length", "12", "--max-new-tokens", "24", "--target-step", "static", "--hf-tokens", "4",
                 "--dtype", "float32", "--int8-drafter", "--out", str(tmp_path)]) == 0
    assert "int8 drafter linears" in (tmp_path / "replay.md").read_text()


def test_ab_setting_flips_or_sets_each_switch_and_restores_it():
    """The scripts' one table of A/B settings: a switch set off / on or flipped from where it stands (None, "on where
    it applies", counts as on) in the policy and options given (``dataclasses.replace``: they stay as they were),
    int8_drafter applied only when on and undone after the block."""
    from modeling_weaver.lab.replay import ab_setting, ab_switches
    from modeling_weaver.options import StepOptions, TreePolicy
    from modeling_weaver.packed import _INT8

    drafter, target = torch.nn.Sequential(torch.nn.Linear(16, 16)), torch.nn.Linear(2, 2)
    assert {"spine", "node_attention", "int8_head", "int8_drafter", "gates_in_kernel"} <= set(ab_switches())
    policy, options = TreePolicy(), StepOptions()
    spine = policy.spine
    setting, label = ab_setting("spine", None, drafter, target, policy, options)
    with setting as (changed, same):
        assert changed.spine is (not spine) and label == f"spine={not spine}" and same is options
    assert policy.spine is spine
    attention = policy.fused_node_attention
    with ab_setting("node_attention", None, drafter, target, policy)[0] as (changed, _):
        assert changed.fused_node_attention is (attention is False)
    for on in (False, True):
        with ab_setting("node_attention", on, drafter, target, policy)[0] as (changed, _):
            assert changed.fused_node_attention is on
    with ab_setting("gates_in_kernel", None, drafter, target, policy, options)[0] as (same, changed):
        assert same is policy and changed == StepOptions(gates_in_kernel=False)
    assert policy.fused_node_attention is attention and options == StepOptions()
    with ab_setting("int8_drafter", False, drafter, target)[0]:
        assert not hasattr(drafter[0], _INT8)
    setting, label = ab_setting("int8_drafter", None, drafter, target)
    with setting:
        assert hasattr(drafter[0], _INT8) and label == "int8_drafter=True"
    assert not hasattr(drafter[0], _INT8)


def test_a_hub_shape_shrinks_with_its_layer_kinds_and_experts():
    """--shape-scale / --shape-layers (CPU smoke runs of a hub shape): widths divided alike in the three configs (they
    still pair), the expert count never below the routed top-k, the first layers kept only when they hold every
    layer kind; the full shape's configs untouched."""
    from modeling_weaver.export import HUB_SPECS
    from modeling_weaver.lab.replay import shrunk_configs

    spec = HUB_SPECS["qwen3.5-35b-a3b"]
    t = spec.target()
    d = spec.dflash(t)
    w = spec.weaver(t, d)
    assert shrunk_configs(t, d, w) == (t, d, w)
    st, sd, sw = shrunk_configs(t, d, w, scale=64, layers=4)
    assert (st.hidden_size, st.num_experts, st.num_experts_per_tok, st.moe_intermediate_size) == (32, 8, 8, 8)
    assert st.layer_types == t.layer_types[:4] and st.num_hidden_layers == 4 and t.num_hidden_layers == 40
    assert (st.num_attention_heads, st.linear_num_value_heads) == (t.num_attention_heads, t.linear_num_value_heads)
    assert sd.hidden_size == sw.d_model == 32 and sd.vocab_size == st.vocab_size == t.vocab_size // 64
    assert sd.num_target_layers == 4 and sd.target_layer_ids == [0, 1, 2, 3]
    assert sd.mask_token_id == st.vocab_size - (t.vocab_size - d.mask_token_id) and sd.block_size == d.block_size
    assert shrunk_configs(t, d, w, layers=12)[1].target_layer_ids == [1, 3, 5, 7, 9]
    with pytest.raises(ValueError, match="every layer kind"):
        shrunk_configs(t, d, w, scale=16, layers=3)  # three GDN layers, no attention layer
    kimi = HUB_SPECS["kimi-linear-48b-a3b"]
    with pytest.raises(ValueError, match="not supported"):
        shrunk_configs(kimi.target(), None, None, scale=16)
    with pytest.raises(ValueError, match="cannot be shrunk"):
        random_models("tiny", torch.device("cpu"), torch.float32, scale=2)


@pytest.mark.parametrize("target_step", ["eager", "static"])
def test_replay_runs_the_hybrid_moe_shape_shrunk(tmp_path, target_step):
    """`weaver replay --shape qwen3.5-35b-a3b` (issue #30's table) at the shape shrunk: GDN + gated attention + routed
    experts with the gated shared expert, every method at budget 64, bf16 as on the GPU, eager and fixed-shape steps
    (the path compiled / graph steps take, without compile or capture)."""
    from modeling_weaver.cli import main

    assert main(["replay", "--shape", "qwen3.5-35b-a3b", "--shape-scale", "32", "--shape-layers", "4",
                 "--synthetic-mal", "chain=4", "ddtree=5.4", "weaver=7.1", "--budgets", "64", "--prompt-length", "8",
                 "--max-new-tokens", "24", "--target-step", target_step, "--hf-tokens", "0", "--out",
                 str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "replay.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["ar", "weaver@64", "ddtree@64", "chain@64"]
    assert all(r["tokens_per_s"] > 0 for r in rows) and all(r["mal"] > 2.5 for r in rows[1:])
    assert "qwen3.5-35b-a3b (shrunk: widths / 32, first 4 layers), bfloat16" in (tmp_path / "replay.md").read_text()


def test_an_ar_token_of_a_moe_target_reads_its_routed_experts_share():
    from tiny_targets import tiny_llama, tiny_qwen3_5_moe

    dense = tiny_llama()
    total = sum(p.numel() * p.element_size() for p in dense.parameters())
    assert token_weight_bytes(dense) == (total, total)
    moe = tiny_qwen3_5_moe()  # 4 experts, top-2: a token reads half of the routed experts' bytes, all the rest
    routed = sum(p.numel() * p.element_size() for n, p in moe.named_parameters() if ".experts." in n)
    total = sum(p.numel() * p.element_size() for p in moe.parameters())
    assert routed > 0 and token_weight_bytes(moe) == (total, total - routed // 2)


def test_experts_implementation_is_set_on_every_experts_config():
    """--experts-implementation (the GPU run's fallback should grouped_mm not capture): every MoE layer's experts
    read the setting; a dense target has none to set."""
    from modeling_weaver.lab.replay import set_experts_implementation

    target, _, _ = random_models("qwen3.5-35b-a3b", torch.device("cpu"), torch.float32, scale=64, layers=4)
    experts = [m for m in target.modules() if type(m).__name__.endswith("Experts")]
    assert len(experts) == 4 and all(m.config._experts_implementation == "grouped_mm" for m in experts)
    assert set_experts_implementation(target, "batched_mm") >= 1
    assert all(m.config._experts_implementation == "batched_mm" for m in experts)
    assert set_experts_implementation(random_models("tiny", torch.device("cpu"), torch.float32)[0], "eager") == 0


def test_spread_map_splits_the_layers_in_order_and_covers_every_weight(tmp_path, capsys):
    """`weaver replay --devices N` (issue #33's table): the device_map puts the embedding first, the layers in order
    in even runs, the norm and lm_head last, and covers every parameter (a ForCausalLM, and Qwen3.5's multimodal
    wrapper whose vision tower goes first); on a machine without the GPUs it asks for, the run stops at once."""
    from tiny_targets import tiny_qwen3
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from modeling_weaver.cli import main
    from modeling_weaver.lab.replay import spread_map

    def covered(model, placement):
        return all(any(name == key or name.startswith(key + ".") for key in placement)
                   for name, _ in model.named_parameters())

    target = tiny_qwen3()
    placement = spread_map(target, ["a", "b", "c"])
    assert [placement[f"model.layers.{i}"] for i in range(3)] == ["a", "b", "c"]
    assert placement["model.embed_tokens"] == "a" and placement["model.norm"] == placement["lm_head"] == "c"
    assert covered(target, placement)
    config = Qwen3_5Config(text_config=dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                            linear_value_head_dim=8),
                           vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                                              out_hidden_size=32))
    wrapped = Qwen3_5ForConditionalGeneration(config)
    placement = spread_map(wrapped, ["a", "b"])
    assert placement["model.visual"] == "a" and placement["lm_head"] == "b"
    assert [placement[f"model.language_model.layers.{i}"] for i in range(4)] == ["a", "a", "b", "b"]
    assert covered(wrapped, placement)
    assert main(["replay", "--shape", "tiny", "--synthetic-mal", "chain=2", "--devices", "1", "2", "--target-step",
                 "eager", "--out", str(tmp_path / "out")]) == 1
    assert "--devices 1 2 spreads the target over that many GPUs" in capsys.readouterr().err

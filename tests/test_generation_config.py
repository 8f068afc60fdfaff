"""Generation settings (issue 26): each one is either honoured exactly (greedy output equal to ``target.generate`` with
the same config) or refused with a ValueError naming it; the tree budget has a bound, checked before allocation."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_generate import make_drafters
from tiny_targets import VOCAB, tiny_llama, tiny_qwen3_5

import modeling_weaver.tree as tree_module
from modeling_weaver import generate, speculative_generate
from modeling_weaver.generate import MODES, REFUSED

ROOT = Path(__file__).resolve().parents[1]


def setup(factory=tiny_llama):
    """A tiny target whose greedy continuation meets its eos early (the continuation's most frequent token)."""
    target = factory()
    drafter, weaver = make_drafters(target)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    cont = ar(target, ids, max_new_tokens=40, min_new_tokens=0)[0, ids.shape[1]:].tolist()
    eos = max(set(cont[1:]), key=cont.count)
    target.generation_config.eos_token_id = eos
    target.generation_config.pad_token_id = 0
    return target, drafter, weaver, ids, cont.index(eos) + 1


def ar(target, ids, **kwargs):
    return target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)


def spec(target, drafter, weaver, ids, mode="ddtree", **kwargs):
    return speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget=12, **kwargs)


@pytest.mark.parametrize("factory", [tiny_llama, tiny_qwen3_5])
@pytest.mark.parametrize("field", ["min_new_tokens", "min_length"])
def test_min_length_in_generation_config(factory, field):
    target, drafter, weaver, ids, first_eos = setup(factory)
    target.generation_config.max_new_tokens = 40
    setattr(target.generation_config, field, 20 + (ids.shape[1] if field == "min_length" else 0))
    expected = ar(target, ids)
    assert expected.shape[1] - ids.shape[1] > max(first_eos, 20) - 1  # eos held back past where it first came
    for mode in MODES:
        assert torch.equal(spec(target, drafter, weaver, ids, mode), expected), mode
    via_hf = target.generate(ids, custom_generate=generate, drafter=drafter, weaver=weaver, mode="chain",
                             tree_budget=8)
    assert torch.equal(via_hf, expected)


def test_min_new_tokens_when_sampling():
    """Sampling with an eos made likely (a single-token sequence bias): no eos before min_new_tokens, in every mode
    and both verifications, and one soon after."""
    target, drafter, weaver, ids, _ = setup()
    eos = target.generation_config.eos_token_id
    target.generation_config.sequence_bias = {(eos,): 8.0}
    target.generation_config.min_new_tokens = 12
    for mode in MODES:
        for verification in ("target_only", "traversal"):
            new = spec(target, drafter, weaver, ids, mode, do_sample=True, max_new_tokens=40, verification=verification,
                       generator=torch.Generator().manual_seed(1))[0, ids.shape[1]:].tolist()
            assert eos not in new[:12] and eos in new[12:], (mode, verification, new)


def test_lengths_from_generation_config():
    target, drafter, weaver, ids, _ = setup()
    target.generation_config.eos_token_id = None
    target.generation_config.max_new_tokens = 5
    assert spec(target, drafter, weaver, ids).shape[1] == ids.shape[1] + 5 == ar(target, ids).shape[1]
    target.generation_config.max_new_tokens = None
    target.generation_config.max_length = ids.shape[1] + 7
    assert torch.equal(spec(target, drafter, weaver, ids), ar(target, ids))
    assert spec(target, drafter, weaver, ids, max_new_tokens=3).shape[1] == ids.shape[1] + 3  # the argument wins
    target.generation_config.max_length = None
    assert spec(target, drafter, weaver, ids).shape[1] == ids.shape[1] + 128  # nothing set: the documented default


# field -> value: applied exactly (equal to target.generate) ...
APPLIED = {
    "bad_words_ids": [[5], [7]],
    "sequence_bias": {(5,): -3.0, (9,): 2.0},
    "exponential_decay_length_penalty": (3, 1.6),
    "suppress_tokens": [5, 9],
    "begin_suppress_tokens": [5, 9],
    "forced_eos_token_id": None,  # (the target's eos)
    "remove_invalid_values": True,
    "renormalize_logits": True,
}
# ... or refused by name
REFUSED_VALUES = {
    "bad_words_ids": [[5, 6]],
    "sequence_bias": {(5, 6): -3.0},
    "repetition_penalty": 1.3,
    "no_repeat_ngram_size": 2,
    "num_beams": 2,
    "num_return_sequences": 2,
    "output_scores": True,
    "prompt_lookup_num_tokens": 3,
    "guidance_scale": 1.5,
}


@pytest.mark.parametrize("field", list(APPLIED))
def test_applied_fields_equal_generate(field):
    target, drafter, weaver, ids, _ = setup()
    value = target.generation_config.eos_token_id if field == "forced_eos_token_id" else APPLIED[field]
    setattr(target.generation_config, field, value)
    target.generation_config.max_new_tokens = 24
    expected = ar(target, ids)
    for mode in MODES:
        assert torch.equal(spec(target, drafter, weaver, ids, mode), expected), (field, mode)


@pytest.mark.parametrize("field", list(REFUSED_VALUES))
def test_refused_fields_name_themselves(field):
    target, drafter, weaver, ids, _ = setup()
    setattr(target.generation_config, field, REFUSED_VALUES[field])
    with pytest.raises(ValueError, match=field):
        spec(target, drafter, weaver, ids, max_new_tokens=4)
    with pytest.raises(ValueError, match=field):
        target.generate(ids, custom_generate=generate, drafter=drafter, weaver=weaver, mode="chain", tree_budget=4,
                        max_new_tokens=4)


@pytest.mark.parametrize("setting", [{"top_k": -3}, {"top_p": 1.5}, {"top_k": -3, "do_sample": True},
                                     {"temperature": 0.0, "do_sample": True}])
def test_bad_sampling_values_raise(setting):
    target, drafter, weaver, ids, _ = setup()
    field = next(k for k in setting if k != "do_sample")
    with pytest.raises(ValueError, match=field):
        spec(target, drafter, weaver, ids, max_new_tokens=4, **setting)
    if field != "temperature":  # (speculative_generate's temperature is its own argument)
        setattr(target.generation_config, field, setting[field])  # the same value from the target's config
        with pytest.raises(ValueError, match=field):
            spec(target, drafter, weaver, ids, max_new_tokens=4)


def test_ignored_arguments_are_refused():
    target, drafter, weaver, ids, _ = setup()
    for kwargs in ({"assistant_model": target}, {"prompt_lookup_num_tokens": 3}, {"num_beams": 2},
                   {"no_such_setting": 1}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            spec(target, drafter, weaver, ids, max_new_tokens=4, **kwargs)
    # the Hub folder sees assistant_model before transformers drops it
    with pytest.raises(ValueError, match="assistant_model"):
        target.generate(ids, custom_generate=str(ROOT), trust_remote_code=True, drafter=drafter, weaver=weaver,
                        mode="chain", max_new_tokens=4, assistant_model=target)


def test_max_tree_budget(monkeypatch):
    target = tiny_llama()
    assert tree_module.max_tree_budget(target, "cpu") == tree_module.MAX_TREE_BUDGET
    hybrid = tiny_qwen3_5()
    monkeypatch.setattr(tree_module.weaver_kernels, "max_tree_nodes", lambda device: 256)  # (CUDA's limit)
    bound, why = tree_module.tree_budget_bound(hybrid, "cpu")
    assert bound == 255 and "GDN" in why
    assert tree_module.max_tree_budget(target, "cpu") == tree_module.MAX_TREE_BUDGET  # attention only: no limit
    monkeypatch.setattr(tree_module, "_free_memory", lambda device: 2**20)
    bound, why = tree_module.tree_budget_bound(target, "cpu")
    assert 1 <= bound < 200 and "free" in why
    drafter, weaver = make_drafters(target)
    with pytest.raises(ValueError, match=f"max_tree_budget.* = {bound}"):
        speculative_generate(target, torch.tensor([[1, 2]]), drafter=drafter, mode="ddtree", tree_budget=bound + 1)


def test_budget_bound_raises_before_allocating():
    """Under an address-space limit of 1 GiB above what the process has mapped, a huge budget raises the bound's
    ValueError, not a MemoryError (a DDTree step of 100000 nodes once took 12 GB)."""
    script = textwrap.dedent(f"""
        import resource, sys, torch
        sys.path[:0] = [{str(ROOT / 'tests')!r}]
        from test_generate import make_drafters
        from tiny_targets import tiny_llama
        from modeling_weaver import speculative_generate
        target = tiny_llama(); drafter, _ = make_drafters(target)
        mapped = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mapped + 2**30, resource.RLIM_INFINITY))
        try:
            speculative_generate(target, torch.tensor([[1, 2, 3]]), drafter=drafter, mode="ddtree",
                                 tree_budget=100000, max_new_tokens=8)
        except ValueError as err:
            print("ValueError:", err)
    """)
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'kernels'}", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert "ValueError: tree_budget 100000 exceeds max_tree_budget" in run.stdout, run.stdout + run.stderr[-2000:]


def test_readme_lists_exactly_the_refused_settings():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("**What is refused**"):]
    section = section[:section.index("\n- ")]
    listed = set(re.findall(r"`([a-z_]+)`", section))
    assert listed == set(REFUSED), (listed ^ set(REFUSED))


_TARGETS = {}


@settings(max_examples=36, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    mode=st.sampled_from(MODES),
    prompt_len=st.integers(1, 9),
    max_new=st.one_of(st.none(), st.integers(1, 30)),
    max_length_extra=st.one_of(st.none(), st.integers(1, 30)),
    min_new=st.one_of(st.none(), st.integers(0, 25)),
    min_length_extra=st.one_of(st.none(), st.integers(0, 25)),
    eos=st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3)),
    temperature=st.one_of(st.none(), st.floats(0.1, 3.0)),
    top_k=st.one_of(st.none(), st.integers(1, 60)),
    top_p=st.one_of(st.none(), st.floats(0.05, 1.0)),
    seed=st.integers(0, 2**16),
)
def test_random_generation_configs_equal_generate(mode, prompt_len, max_new, max_length_extra, min_new,
                                                  min_length_extra, eos, temperature, top_k, top_p, seed):
    """Greedy, random combinations of supported generation_config fields: speculative output equals AR's."""
    if not _TARGETS:
        _TARGETS["llama"] = (tiny_llama(), *make_drafters(tiny_llama()))
    target, drafter, weaver = _TARGETS["llama"]
    ids = torch.randint(0, VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
    if eos is None:  # often an eos that the continuation meets early
        eos = [int(ar(target, ids, max_new_tokens=3, pad_token_id=0)[0, -1])] if seed % 2 else None
    plus = lambda extra: None if extra is None else prompt_len + extra  # noqa: E731
    config = dict(max_new_tokens=max_new, max_length=plus(max_length_extra), min_new_tokens=min_new,
                  min_length=plus(min_length_extra),
                  eos_token_id=eos, temperature=temperature, top_k=top_k, top_p=top_p, do_sample=False, pad_token_id=0)
    if max_new is None and max_length_extra is None:
        config["max_new_tokens"] = 20  # (the two defaults differ: 20 for transformers, 128 here)
    saved = target.generation_config
    target.generation_config = saved.__class__(**{k: v for k, v in config.items() if v is not None})
    try:
        expected = ar(target, ids)
        got = spec(target, drafter, weaver, ids, mode)
    finally:
        target.generation_config = saved
    assert torch.equal(got, expected), (config, expected.tolist(), got.tolist())

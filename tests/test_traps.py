"""API traps a newcomer falls into (issue 28, item 4): ``streamer=`` with the callable ``custom_generate``, the
``custom_generate`` folder passed instead of its repo, and the candidate pool of ``WeaverConfig.from_target_config``
for a small vocabulary."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import pytest
import torch
from test_generate import make_drafters
from tiny_targets import VOCAB, tiny_llama

from modeling_weaver import DFlashConfig, WeaverConfig, WeaverModel, generate, speculative_generate
from modeling_weaver.pairing import check_pair

ROOT = Path(__file__).resolve().parents[1]
IDS = torch.tensor([[3, 7, 11, 2, 5]])


class Recorder:
    """A transformers streamer (``put`` / ``end``) that keeps what it is given."""

    def __init__(self):
        self.chunks, self.ended = [], 0

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended += 1


@pytest.fixture(scope="module")
def models():
    target = tiny_llama()
    drafter, weaver = make_drafters(target)
    return target, drafter, weaver


def test_streamer_with_the_callable_custom_generate(models):
    """``target.generate(..., custom_generate=generate, streamer=s)``: transformers sends ``s`` the prompt and keeps
    it; our loop finds it and streams every committed token to it, then ``end()`` (it once streamed nothing)."""
    target, drafter, weaver = models
    streamer = Recorder()
    out = target.generate(IDS, attention_mask=torch.ones_like(IDS), custom_generate=generate, drafter=drafter,
                          weaver=weaver, mode="ddtree", tree_budget=6, max_new_tokens=10, streamer=streamer)
    assert streamer.chunks[0] == IDS[0].tolist()  # the prompt, once
    assert sum(streamer.chunks[1:], []) == out[0, IDS.shape[1]:].tolist()
    assert streamer.ended == 1


def test_streamer_and_tree_streamer_together_are_refused(models):
    target, drafter, weaver = models
    with pytest.raises(ValueError, match="tree_streamer"):
        target.generate(IDS, attention_mask=torch.ones_like(IDS), custom_generate=generate, drafter=drafter,
                        mode="chain", tree_budget=4, max_new_tokens=4, streamer=Recorder(), tree_streamer=Recorder())
    same = Recorder()  # (the same object twice is one streamer)
    target.generate(IDS, attention_mask=torch.ones_like(IDS), custom_generate=generate, drafter=drafter,
                    mode="chain", tree_budget=4, max_new_tokens=4, streamer=same, tree_streamer=same)


def test_streamer_through_wrappers_of_generate(models):
    """A wrapper of ``generate`` as ``custom_generate`` still streams to ``streamer=``; a wrapper too deep for the
    frame lookup to trust warns (the streamer then gets the prompt only) instead of dropping it silently."""
    target, drafter, weaver = models

    def wrapped(depth):
        @functools.wraps(generate)  # (transformers reads the custom arguments from the signature)
        def call(*args, _depth=depth, **kwargs):
            return call(*args, _depth=_depth - 1, **kwargs) if _depth else generate(*args, **kwargs)
        return call

    kwargs = dict(attention_mask=torch.ones_like(IDS), drafter=drafter, mode="chain", tree_budget=4, max_new_tokens=6)
    near = Recorder()
    out = target.generate(IDS, custom_generate=wrapped(2), streamer=near, **kwargs)
    assert sum(near.chunks[1:], []) == out[0, IDS.shape[1]:].tolist() and near.ended == 1
    far = Recorder()
    with pytest.warns(UserWarning, match="tree_streamer"):
        target.generate(IDS, custom_generate=wrapped(12), streamer=far, **kwargs)
    assert far.chunks == [IDS[0].tolist()] and far.ended == 0


def test_caller_streamer_reads_only_the_frame_it_knows():
    """Which frame ``caller_streamer`` reads: transformers' ``generate`` with a callable ``custom_generate`` (its
    ``streamer``), none when no transformers code called, and a warning when transformers code it does not know
    did."""
    from modeling_weaver.generate import caller_streamer

    def ask():  # (stands for our generate: caller_streamer reads the frame that called it)
        return caller_streamer()

    fake = {"__name__": "transformers.generation.utils", "ask": ask}
    exec("def generate(custom_generate, streamer):\n    return ask()\n"
         "def elsewhere():\n    return ask()\n", fake)
    streamer = Recorder()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fake["generate"](generate, streamer) is streamer
        assert fake["generate"]("owner/repo", streamer) is None  # (transformers passed it on itself)
        assert ask() is None
    with pytest.warns(UserWarning, match="tree_streamer"):
        assert fake["elsewhere"]() is None


def test_custom_generate_given_the_folder_itself(models):
    """``custom_generate="<repo>/custom_generate"`` runs the same recipe as ``custom_generate="<repo>"``
    (transformers looks for ``custom_generate/generate.py`` inside the folder it is given)."""
    target, drafter, weaver = models
    kwargs = dict(attention_mask=torch.ones_like(IDS), trust_remote_code=True, drafter=drafter, weaver=weaver,
                  mode="ddtree", tree_budget=6, max_new_tokens=8)
    expected = target.generate(IDS, custom_generate=str(ROOT), **kwargs)
    assert torch.equal(target.generate(IDS, custom_generate=str(ROOT / "custom_generate"), **kwargs), expected)
    from modeling_weaver.output_dir import with_banner

    nested = ROOT / "custom_generate" / "custom_generate"
    for name in ("generate.py", "requirements.txt"):
        source = (ROOT / "custom_generate" / name).read_text(encoding="utf-8")
        assert (nested / name).read_text(encoding="utf-8") == with_banner(source, f"custom_generate/{name}")


def test_exported_repos_carry_the_nested_recipe(tmp_path):
    from modeling_weaver.export import write_custom_generate

    from modeling_weaver.output_dir import with_banner

    write_custom_generate(tmp_path)
    source = with_banner((ROOT / "custom_generate/generate.py").read_text(encoding="utf-8"), "custom_generate/generate.py")
    for folder in ("custom_generate", "custom_generate/custom_generate"):
        assert (tmp_path / folder / "generate.py").read_text(encoding="utf-8") == source


def test_from_target_config_pool_fits_the_vocabulary():
    """A target whose vocabulary (97) is smaller than the default pool (512): the builder derives a pool that fits,
    and the pairing check accepts the pair it built (it once refused it)."""
    target = tiny_llama()
    dconfig = DFlashConfig.from_target_config(target.config, num_hidden_layers=2, block_size=4,
                                              target_layer_ids=[0, 1])
    wconfig = WeaverConfig.from_target_config(target.config, dconfig, d_rank=32, num_heads=4, mlp_dim=64)
    assert wconfig.candidate_pool_size == VOCAB
    check_pair(target.config, dconfig, wconfig, target_vocab_size=VOCAB)
    from modeling_weaver import DFlashDraftModel

    drafter, weaver = DFlashDraftModel(dconfig).eval(), WeaverModel(wconfig).eval()
    out = speculative_generate(target, IDS, drafter=drafter, weaver=weaver, mode="weaver", tree_budget=6,
                               max_new_tokens=6)
    assert out.shape[1] > IDS.shape[1]
    assert WeaverConfig.from_target_config(target.config, dconfig, d_rank=32, num_heads=4).candidate_pool_size <= 512
    with pytest.raises(ValueError, match="candidate_pool_size"):
        WeaverConfig.from_target_config(target.config, dconfig, d_rank=32, num_heads=4, candidate_pool_size=VOCAB + 1)

"""Training-data pipeline: eval prompt loaders, deduplication, the eval-leak check, regeneration by a tiny target.

Also home of the tiny chat tokenizer and the saved tiny target used by test_training.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import string

import pytest
import torch
from tiny_targets import VOCAB, tiny_llama

from modeling_weaver.lab.data import (
    DataSettings,
    Deduplicator,
    FetchError,
    LeakChecker,
    TokenDataset,
    add_make_data_arguments,
    chat_prompt_ids,
    deduplicate,
    load_humaneval,
    load_mtbench,
    make_training_data,
    normalize_text,
    run_make_data,
    sha256_file,
    user_turn_prefix,
    write_shard,
)

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_chat_tokenizer(vocab_size: int = VOCAB):
    """Character-level tokenizer of exactly ``vocab_size`` ids with ChatML specials (eos = ``<|im_end|>``)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
    chars = list(string.ascii_lowercase + string.ascii_uppercase + string.digits + " \n" + string.punctuation)
    tokens = (specials + chars)[:vocab_size]
    assert len(tokens) == vocab_size
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(specials)
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<|im_start|>", eos_token="<|im_end|>", chat_template=CHATML)


def save_tiny_target(path, seed: int = 0):
    """A tiny random Llama + tiny chat tokenizer saved as a model folder (what ``--target PATH`` loads)."""
    model, tokenizer = tiny_llama(seed), tiny_chat_tokenizer()
    with torch.no_grad():  # a confident target (peaked logits): its outputs are learnable in a few steps
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("tiny_target"))


# --- normalisation and deduplication ----------------------------------------------------------------------------------


def test_normalize_text():
    assert normalize_text("  Hello,   WORLD!\n\tIt's  ok_ ") == "hello world it s ok"


def test_deduplication_exact_and_near():
    texts = ["Write a poem.", "Write a poem.", "write a POEM!!", "  ", "Write two poems.", "Write a poem"]
    assert deduplicate(texts) == [0, 4]
    d = Deduplicator()
    for t in texts:
        d.add(t)
    assert d.counts == {"exact": 1, "near": 2, "empty": 1}


# --- eval-leak check -------------------------------------------------------------------------------------------------

EVAL = {
    "mtbench/81": "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
                  "experiences and must-see attractions.",
    "humaneval/0": "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n    \"\"\" Check if in "
                   "given list of numbers, are any two numbers closer to each other than given threshold.\"\"\"",
    "short/1": "Say hi to Bob",
}


def test_leak_check_flags_copies_and_partial_copies():
    checker = LeakChecker(EVAL, n=8, threshold=0.2)
    verbatim = "Sure! " + EVAL["mtbench/81"].upper() + " Thanks."
    assert checker.check(verbatim)[0] == "mtbench/81"
    # Half of the question, re-punctuated: still a leak.
    half = "please: compose an engaging travel blog post about a recent trip -- to Hawaii"
    key, overlap = checker.check(half)
    assert key == "mtbench/81" and overlap >= 0.2
    # The HumanEval problem pasted into a response.
    assert checker.check("Here you go:\n" + EVAL["humaneval/0"] + "\n    return False")[0] == "humaneval/0"
    # Short eval prompts (fewer words than n) match as a whole.
    assert checker.check("ok, say hi to bob now")[0] == "short/1"


def test_leak_check_ignores_unrelated_and_shared_phrases():
    checker = LeakChecker(EVAL, n=8, threshold=0.2)
    assert checker.check("Write a short story about a dragon who learns to bake bread.") is None
    assert checker.check("Plan a trip to Hawaii with cultural experiences.") is None  # topic overlap, no copying
    assert checker.check("say hi") is None


def test_leak_check_real_eval_prompts():
    try:
        mtbench, humaneval = load_mtbench(), load_humaneval()
    except FetchError as exc:
        pytest.skip(f"eval wheels unavailable: {exc}")
    assert len(mtbench) == 80 and len(humaneval) == 164
    assert all(p.text for p in mtbench + humaneval)
    assert humaneval[0].source in humaneval[0].text and "```python" in humaneval[0].text
    checker = LeakChecker()
    assert len(checker.num_grams) == 244
    assert checker.check("Answer this: " + mtbench[5].text)[0] == f"mtbench/{mtbench[5].id}"
    assert checker.check(humaneval[7].source)[0] == f"humaneval/{humaneval[7].id}"
    assert checker.check("What is the best way to learn to play the guitar as an adult beginner?") is None


# --- shards and regeneration -----------------------------------------------------------------------------------------


def test_shards_roundtrip_and_cross_shard_dedup(tmp_path):
    a = [{"input_ids": [1, 2, 3, 4], "prompt_len": 2, "greedy": True, "prompt_hash": 11},
         {"input_ids": [5, 6, 7], "prompt_len": 1, "greedy": False, "prompt_hash": 12}]
    b = [{"input_ids": [8, 9], "prompt_len": 1, "greedy": True, "prompt_hash": 11},  # repeats a prompt of shard a
         {"input_ids": [1, 1, 1], "prompt_len": 2, "greedy": True, "prompt_hash": 13}]
    write_shard(tmp_path / "shard-r0-00000.pt", a)
    write_shard(tmp_path / "shard-r1-00000.pt", b)
    ds = TokenDataset(tmp_path, max_length=3)
    assert len(ds) == 3 and ds.num_tokens == 10
    ids, plen = ds[0]
    assert ids.tolist() == [1, 2, 3] and plen == 2 and ids.dtype == torch.long


def test_chat_template_prefix(tiny_target_dir):
    tok = tiny_chat_tokenizer()
    assert user_turn_prefix(tok) == "<|im_start|>user\n"
    ids = chat_prompt_ids(tok, "hi")
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


class _FlagEveryOther(LeakChecker):
    """Marks every second checked text as a leak (to see the pipeline drop and count them)."""

    def __init__(self):
        super().__init__({"x/1": "unused"})
        self.calls = 0

    def check(self, text):
        self.calls += 1
        return ("x/1", 1.0) if self.calls % 2 == 0 else None


@pytest.mark.parametrize("sampler", ["hf", "ours"])
def test_make_training_data_tiny(tmp_path, sampler):
    model, tok = tiny_llama(), tiny_chat_tokenizer()
    settings = DataSettings(num_samples=6, batch_size=4, max_prompt_tokens=12, min_prompt_words=0,
                            keep_unfinished_prompts=True, max_response_tokens=10, shard_size=4, greedy_fraction=0.5,
                            seed=1, sampler=sampler)
    checker = _FlagEveryOther()
    stats = make_training_data(model, tok, tmp_path, settings, leak_checker=checker, progress=False)
    assert stats.samples == 6 and stats.leaks > 0
    ds = TokenDataset(tmp_path)
    assert len(ds) == 6 and ds.num_tokens == stats.tokens
    prefix = tok(user_turn_prefix(tok), add_special_tokens=False)["input_ids"]
    for i in range(len(ds)):
        ids, plen = ds[i]
        assert ids[: len(prefix)].tolist() == prefix and 0 < plen < len(ids) <= plen + 10
        assert tok.decode(ids[:plen]).endswith("<|im_start|>assistant\n")
    manifest = json.loads((tmp_path / "manifest-r0.json").read_text())
    assert manifest["stats"]["samples"] == 6
    lines = (tmp_path / "prompts-r0.jsonl").read_text().splitlines()
    assert len(lines) == 6 and len(list(tmp_path.glob("shard-*.pt"))) == 2
    # Greedy responses are the target's own greedy continuation.
    greedy = [json.loads(x)["greedy"] for x in lines]
    if any(greedy):
        i = greedy.index(True)
        ids, plen = ds[i]
        prompt = ids[None, :plen]
        ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=len(ids) - plen,
                             do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        assert ref[0, plen:].tolist() == ids[plen:].tolist()


def test_make_training_data_mix_and_manifest(tmp_path):
    """With a mix, user turns come from every source in it; the manifest lets each shard be checked and regenerated
    (same seed → same shards)."""
    from modeling_weaver.lab.prompts import SOURCES

    model, tok = tiny_llama(), tiny_chat_tokenizer()
    settings = DataSettings(num_samples=16, batch_size=8, max_prompt_tokens=12, min_prompt_words=0,
                            keep_unfinished_prompts=True, max_response_tokens=6, shard_size=8, seed=3, sampler="hf",
                            mix="self=0.25,template=0.25,math=0.25,code=0.25")
    stats = make_training_data(model, tok, tmp_path / "a", settings, leak_checker=LeakChecker(EVAL), progress=False)
    assert stats.samples == 16
    rows = [json.loads(x) for x in (tmp_path / "a" / "prompts-r0.jsonl").read_text().splitlines()]
    assert {r["source"] for r in rows} == {"self", "template", "math", "code"}
    manifest = json.loads((tmp_path / "a" / "manifest-r0.json").read_text())
    assert manifest["settings"]["seed"] == 3 and manifest["prompt_sources"]["functions"] > 100
    assert [s["samples"] for s in manifest["shards"]] == [8, 8]
    assert sum(s["tokens"] for s in manifest["shards"]) == stats.tokens
    for entry in manifest["shards"]:
        assert sha256_file(tmp_path / "a" / entry["file"]) == entry["sha256"]
        shard = torch.load(tmp_path / "a" / entry["file"], weights_only=True)
        assert shard["source"].tolist() and max(shard["source"].tolist()) < len(SOURCES)
    again = make_training_data(model, tok, tmp_path / "b", settings, leak_checker=LeakChecker(EVAL), progress=False)
    assert again.tokens == stats.tokens
    for entry in manifest["shards"]:
        first = torch.load(tmp_path / "a" / entry["file"], weights_only=True)["input_ids"]
        assert torch.equal(first, torch.load(tmp_path / "b" / entry["file"], weights_only=True)["input_ids"])
    # Held-out turns are never used: the same seed with them excluded writes none of them.
    held = dataclasses.replace(settings, exclude_prompts=[str(tmp_path / "a" / "prompts-r0.jsonl")])
    make_training_data(model, tok, tmp_path / "c", held, leak_checker=LeakChecker(EVAL), progress=False)
    used = {json.loads(x)["prompt"] for x in (tmp_path / "c" / "prompts-r0.jsonl").read_text().splitlines()}
    assert used and not used & {r["prompt"] for r in rows}


def test_prompt_mix_validation():
    from modeling_weaver.lab.prompts import PromptMixer, parse_mix

    assert parse_mix("self=1,code=1") == {"self": 1.0, "code": 1.0}
    with pytest.raises(ValueError, match="unknown prompt sources"):
        parse_mix("self=1,poems=1")
    with pytest.raises(ValueError, match="name=weight"):
        parse_mix("self")
    with pytest.raises(ValueError, match="positive sum"):
        PromptMixer(0, {"self": 0.0})
    mixer = PromptMixer(5, {"self": 1.0, "passage": 1.0})
    assert mixer.self_fraction == 0.5
    assert {mixer.sample()[0] for _ in range(5)} == {"passage"}
    assert [PromptMixer(9).sample() for _ in range(1)] == [PromptMixer(9).sample()]


def test_make_data_cli(tiny_target_dir, tmp_path, monkeypatch):
    parser = add_make_data_arguments(argparse.ArgumentParser())
    assert "leak" in parser.format_help()
    # The CLI builds the default checker from MT-Bench/HumanEval; keep the test offline-safe with a planted one.
    monkeypatch.setattr("modeling_weaver.lab.data.LeakChecker", lambda **kw: LeakChecker(EVAL, **kw))
    args = parser.parse_args(["--target", str(tiny_target_dir), "--out", str(tmp_path / "d"), "--num-samples", "3",
                              "--batch-size", "3", "--max-prompt-tokens", "8", "--max-response-tokens", "8",
                              "--min-prompt-words", "0", "--keep-unfinished-prompts", "--no-progress",
                              "--device", "cpu"])
    assert run_make_data(args) == 0
    assert len(TokenDataset(tmp_path / "d")) == 3


def test_make_data_cli_reports_bad_target(tmp_path, capsys):
    args = add_make_data_arguments(argparse.ArgumentParser()).parse_args(
        ["--target", str(tmp_path / "missing"), "--out", str(tmp_path / "d")])
    assert run_make_data(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")


def test_barren_generation_stops_with_a_reason(tmp_path):
    """A target that never ends its user turn within the limit: a clear error, not an endless loop."""
    settings = DataSettings(num_samples=2, batch_size=2, max_prompt_tokens=2, max_response_tokens=2)
    with pytest.raises(RuntimeError, match="no usable user turn in 20 rounds"):
        make_training_data(tiny_llama(), tiny_chat_tokenizer(), tmp_path, settings, leak_checker=LeakChecker(EVAL),
                           progress=False)
    with pytest.raises(FileExistsError, match=r"shard-r0-00000.pt, .*prompts-r0.jsonl, .*manifest-r0.json already exist: .*another --tag or --out"):
        write_shard(tmp_path / "shard-r0-00000.pt", [{"input_ids": [1, 2], "prompt_len": 1, "greedy": True,
                                                      "prompt_hash": 1}])
        make_training_data(tiny_llama(), tiny_chat_tokenizer(), tmp_path, settings, progress=False)

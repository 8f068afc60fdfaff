"""Every file we load, malformed (issue 28, item 5): config.json, *.safetensors, the paper's Weaver .pth and
``training_state.pt``. Each gives a ValueError naming the file (and the field where there is one); none executes
code: a pickle planted to write a marker file is refused, and the marker never appears."""

from __future__ import annotations

import json
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch
from test_generate import make_drafters
from test_hub import WCFG, released_state_dict, save_pth
from tiny_targets import tiny_llama

from modeling_weaver import DFlashDraftModel, WeaverModel
from modeling_weaver.convert import load_dflash, load_weaver
from modeling_weaver.lab.training import STATE_FIELDS, load_training_state


class Planted:
    """Unpickling this writes ``marker`` (what a hostile checkpoint would do with arbitrary code)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('code ran')",)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A good DFlash and Weaver folder of a tiny target."""
    root = tmp_path_factory.mktemp("good")
    drafter, weaver = make_drafters(tiny_llama())
    drafter.save_pretrained(root / "dflash")
    weaver.save_pretrained(root / "weaver")
    return root


def copy_of(saved, role, tmp_path) -> Path:
    dst = tmp_path / role
    shutil.copytree(saved / role, dst)
    return dst


def edit_config(folder: Path, change) -> Path:
    file = folder / "config.json"
    raw = json.loads(file.read_text())
    change(raw)
    file.write_text(json.dumps(raw))
    return file


CONFIG_CASES = {
    "not json": lambda f: f.write_text("{not json"),
    "a list": lambda f: f.write_text("[1, 2]"),
    "empty": lambda f: f.write_text(""),
}
FIELD_CASES = {  # role -> (field, how the field is broken)
    "dflash": ["num_hidden_layers", "hidden_size", "vocab_size", "intermediate_size"],
    "weaver": ["d_model", "d_rank", "num_heads", "K", "candidate_pool_size"],
}


@pytest.mark.parametrize("role", ["dflash", "weaver"])
@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_broken_config_json(saved, tmp_path, role, case):
    folder = copy_of(saved, role, tmp_path)
    CONFIG_CASES[case](folder / "config.json")
    loader = load_dflash if role == "dflash" else load_weaver
    with pytest.raises(ValueError) as info:
        loader(folder)
    assert "config.json" in str(info.value)


@pytest.mark.parametrize("role,field", [(r, f) for r, fields in FIELD_CASES.items() for f in fields])
@pytest.mark.parametrize("broken", ["missing", "string", "zero"])
def test_config_field_missing_or_wrong(saved, tmp_path, role, field, broken):
    """Through our loader and through plain ``from_pretrained`` (AutoModel with trust_remote_code goes there too):
    the error names config.json and the field (a DFlash config without num_hidden_layers once raised an IndexError
    from inside the model)."""
    folder = copy_of(saved, role, tmp_path)
    value = {"string": "abc", "zero": 0}.get(broken)
    edit_config(folder, lambda raw: raw.pop(field) if broken == "missing" else raw.__setitem__(field, value))
    loader = load_dflash if role == "dflash" else load_weaver
    model_class = DFlashDraftModel if role == "dflash" else WeaverModel
    for load in (loader, model_class.from_pretrained):
        with pytest.raises(ValueError) as info:
            load(folder)
        message = str(info.value)
        assert "config.json" in message and field in message, message


SAFETENSORS_CASES = {
    "garbage": lambda f: f.write_bytes(b"\x00\x01garbage" * 10),
    "truncated": lambda f: f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2]),
    "header too long": lambda f: f.write_bytes(struct.pack("<Q", 1 << 40) + b"{}"),
    "header not json": lambda f: f.write_bytes(struct.pack("<Q", 8) + b"{{{{{{{{"),
    "empty": lambda f: f.write_bytes(b""),
}


@pytest.mark.parametrize("case", list(SAFETENSORS_CASES))
def test_broken_safetensors(saved, tmp_path, case):
    folder = copy_of(saved, "dflash", tmp_path)
    file = folder / "model.safetensors"
    SAFETENSORS_CASES[case](file)
    with pytest.raises(ValueError) as info:
        load_dflash(folder)
    assert "model.safetensors" in str(info.value)


def test_safetensors_of_another_shape(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copy_of(saved, "dflash", tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    key = next(iter(sorted(tensors)))
    tensors[key] = torch.zeros(3, 3)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError) as info:
        load_dflash(folder)
    assert key in str(info.value)


def planted_pickles(tmp_path: Path, payload_of) -> list[tuple[Path, Path]]:
    """(file, marker) pairs: the payload with a Planted object, saved by torch.save (zip) and by plain pickle."""
    out = []
    for i, save in enumerate((lambda obj, f: torch.save(obj, f),
                              lambda obj, f: f.write_bytes(pickle.dumps(obj)))):
        marker = tmp_path / f"marker-{i}"
        file = tmp_path / f"planted-{i}.pt"
        save(payload_of(Planted(marker)), file)
        out.append((file, marker))
    return out


def test_the_planted_pickle_is_live(tmp_path):
    """(The check below can fail: loading the planted file the unsafe way does write the marker.)"""
    _, (file, marker) = planted_pickles(tmp_path, lambda evil: {"x": evil})
    pickle.loads(file.read_bytes())
    assert marker.read_text() == "code ran"


def test_planted_weaver_pth_never_runs(tmp_path):
    for file, marker in planted_pickles(
            tmp_path, lambda evil: {"config": WCFG, "state_dict": released_state_dict(), "extra": evil}):
        pth = file.with_suffix(".pth")
        file.rename(pth)
        with pytest.raises(ValueError) as info:
            load_weaver(pth)
        assert str(pth) in str(info.value)
        assert not marker.exists()


PTH_CASES = {
    "garbage": lambda f: f.write_bytes(b"\x80\x04garbage"),
    "a list": lambda f: torch.save([1, 2, 3], f),
    "no state_dict": lambda f: torch.save({"config": WCFG}, f),
    "config not a dict": lambda f: torch.save({"config": 3, "state_dict": released_state_dict()}, f),
    "tensor of another shape": lambda f: torch.save(
        {"config": WCFG, "state_dict": {**released_state_dict(), "token_in.bias": torch.zeros(5)}}, f),
    "field missing": lambda f: save_pth(f, {k: v for k, v in WCFG.items() if k != "d_rank"}, released_state_dict()),
    "empty": lambda f: f.write_bytes(b""),
}


@pytest.mark.parametrize("case", list(PTH_CASES))
def test_broken_weaver_pth(tmp_path, case):
    file = tmp_path / "weaver.pth"
    PTH_CASES[case](file)
    with pytest.raises(ValueError) as info:
        load_weaver(file)
    assert str(file) in str(info.value)


def test_weaver_pth_through_the_shared_loader(tmp_path):
    """The released .pth, training shards and training states share ``files.load_dict_file``; a .pth keeps the
    converter's own error type."""
    from modeling_weaver.convert import CheckpointError

    file = tmp_path / "weaver.pth"
    torch.save([1, 2, 3], file)
    with pytest.raises(CheckpointError, match="expected a dict of config, state_dict"):
        load_weaver(file)


def good_state() -> dict:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    return {"step": 3, "elapsed": 1.5, "model": model.state_dict(), "optimizers": [opt.state_dict()],
            "config": {"hidden_size": 2}, "ema": None, "args": {"lr": 1e-3}}


def test_good_training_state_loads(tmp_path):
    torch.save(good_state(), tmp_path / "training_state.pt")
    assert load_training_state(tmp_path / "training_state.pt")["step"] == 3


def test_planted_training_state_never_runs(tmp_path):
    for file, marker in planted_pickles(tmp_path, lambda evil: {**good_state(), "args": {"x": evil}}):
        with pytest.raises(ValueError) as info:
            load_training_state(file)
        assert str(file) in str(info.value)
        assert not marker.exists()


@pytest.mark.parametrize("field", list(STATE_FIELDS))
@pytest.mark.parametrize("broken", ["missing", "wrong type"])
def test_training_state_fields(tmp_path, field, broken):
    state = good_state()
    if broken == "missing":
        del state[field]
    else:
        state[field] = "abc"
    torch.save(state, tmp_path / "training_state.pt")
    with pytest.raises(ValueError) as info:
        load_training_state(tmp_path / "training_state.pt")
    assert "training_state.pt" in str(info.value) and f"'{field}'" in str(info.value)


@pytest.mark.parametrize("content", [b"", b"garbage", b"PK\x03\x04broken zip"])
def test_training_state_garbage(tmp_path, content):
    (tmp_path / "training_state.pt").write_bytes(content)
    with pytest.raises(ValueError, match="training_state.pt"):
        load_training_state(tmp_path / "training_state.pt")


def test_no_weights_only_false_anywhere():
    """No code path of ours loads a pickle that may run code."""
    root = Path(__file__).resolve().parents[1]
    offenders = [str(p.relative_to(root)) for folder in ("modeling_weaver", "kernels", "scripts", "custom_generate")
                 for p in (root / folder).rglob("*.py") if "weights_only=False" in p.read_text()]
    assert offenders == []


def good_shard(file: Path) -> Path:
    from modeling_weaver.lab.data import write_shard

    write_shard(file, [{"input_ids": [1, 2, 3, 4], "prompt_len": 2, "greedy": True, "prompt_hash": 7},
                       {"input_ids": [5, 6, 7], "prompt_len": 1, "greedy": False, "prompt_hash": 8}])
    return file


def test_good_shard_loads(tmp_path):
    from modeling_weaver.lab.data import TokenDataset

    assert len(TokenDataset(good_shard(tmp_path / "shard-a-00000.pt"))) == 2


SHARD_CASES = {
    "garbage": (None, lambda f: f.write_bytes(b"garbage")),
    "a list": (None, lambda f: torch.save([1], f)),
    "input_ids missing": ("input_ids", lambda s: s.pop("input_ids")),
    "offsets float": ("offsets", lambda s: s.__setitem__("offsets", s["offsets"].float())),
    "prompt_lens 2-D": ("prompt_lens", lambda s: s.__setitem__("prompt_lens", s["prompt_lens"][None])),
    "offsets past the ids": ("offsets", lambda s: s["offsets"].__setitem__(-1, 99)),
    "counts disagree": ("offsets", lambda s: s.__setitem__("prompt_hash", s["prompt_hash"][:1])),
}


@pytest.mark.parametrize("case", list(SHARD_CASES))
def test_broken_shard(tmp_path, case):
    from modeling_weaver.lab.data import TokenDataset

    field, breaks = SHARD_CASES[case]
    file = good_shard(tmp_path / "shard-a-00000.pt")
    if field is None:
        breaks(file)
    else:
        shard = torch.load(file, weights_only=True)
        breaks(shard)
        torch.save(shard, file)
    with pytest.raises(ValueError) as info:
        TokenDataset(tmp_path)
    assert str(file) in str(info.value) and (field is None or f"'{field}'" in str(info.value)), str(info.value)


def test_planted_shard_never_runs(tmp_path):
    from modeling_weaver.lab.data import TokenDataset

    for file, marker in planted_pickles(tmp_path, lambda evil: {"input_ids": evil}):
        with pytest.raises(ValueError, match=str(file)):
            TokenDataset([file])
        assert not marker.exists()


@pytest.mark.parametrize("content,field", [
    ("{not json", None), ("[1]", None), ('{"subfolders": 3}', "subfolders"),
    ('{"generation_defaults": {"tree_budget": "64"}}', "generation_defaults.tree_budget"),
    ('{"generation_defaults": {"mode": "weaver", "num_beams": 4}}', "generation_defaults.num_beams"),
])
def test_broken_speculative_config(saved, tmp_path, content, field):
    """A pair repo's speculative_config.json (read by the custom_generate recipe when drafter= is a path)."""
    from modeling_weaver.export import resolve_drafters

    repo = tmp_path / "repo"
    shutil.copytree(saved / "dflash", repo / "dflash")
    (repo / "speculative_config.json").write_text(content)
    with pytest.raises(ValueError) as info:
        resolve_drafters(tiny_llama(), str(repo), None)
    assert "speculative_config.json" in str(info.value) and (field is None or field in str(info.value))


@pytest.mark.parametrize("line,field", [("{oops", None), ('{"id": 1}', "prompt"), ('["a"]', "prompt"),
                                        ('{"prompt": "hi", "dataset": 3}', "dataset")])
def test_broken_prompt_file(tmp_path, line, field):
    from modeling_weaver.lab.data import load_prompt_file

    file = tmp_path / "prompts.jsonl"
    file.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError) as info:
        load_prompt_file(file)
    assert f"{file}, line 2" in str(info.value) and (field is None or f"'{field}'" in str(info.value))

"""Issue 26, CLI half: the commands that write never delete what they did not create, loaders refuse configs with
missing fields, pair repos cannot point outside themselves, and the CLI refuses bad --device / token / budget flags."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import pytest
import torch
from test_hub import WCFG, released_state_dict, save_pth, write_zlab, zlab_config
from tiny_targets import tiny_qwen3

from modeling_weaver import DFlashConfig, DFlashDraftModel, WeaverConfig, WeaverModel
from modeling_weaver.cli import build_parser, main
from modeling_weaver.convert import (
    DFLASH_REQUIRED_FIELDS,
    WEAVER_REQUIRED_FIELDS,
    CheckpointError,
    load_dflash,
    load_weaver,
)
from modeling_weaver.export import export_pair, resolve_drafters, sync_hub_configs
from modeling_weaver.output_dir import MARKER, OutputOverlapError, is_our_output, written_output


def snapshot(root: Path) -> dict:
    """Every path under ``root`` with its bytes (None for folders): what must survive untouched."""
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None) for p in root.rglob("*")}


def user_folder(path: Path) -> Path:
    """An unrelated folder of the user's, with a subfolder."""
    (path / "sub").mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    (path / "sub" / "data.bin").write_bytes(b"\x00\x01")
    return path


def no_leftovers(parent: Path):
    assert not [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def refused_untouched(capsys, guarded: Path, message: str, *argv):
    """The command fails in one line with ``message`` and ``guarded`` is exactly as it was."""
    before = snapshot(guarded)
    code, _, err = cli(capsys, *argv)
    assert code == 1 and message in err, err
    assert snapshot(guarded) == before


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


# ------------------------------------------------------------------------------------------------------- convert


def test_convert_refuses_an_unrelated_destination_and_leaves_it_untouched(tmp_path, capsys):
    src = write_zlab(tmp_path / "zlab", config=zlab_config())
    dst = user_folder(tmp_path / "dst")
    refused_untouched(capsys, dst, "not a folder written by modeling-weaver", "convert", src, dst, "--overwrite")


@pytest.mark.parametrize("layout", ["src inside dst", "dst inside src", "equal", "symlink to src"])
def test_convert_refuses_overlapping_source_and_destination(tmp_path, capsys, layout):
    if layout == "src inside dst":
        dst = tmp_path / "out"
        assert main(["convert", str(write_zlab(tmp_path / "z0", config=zlab_config())), str(dst)]) == 0
        src = write_zlab(dst / "zlab", config=zlab_config())  # the user keeps the source inside our output
    else:
        src = write_zlab(tmp_path / "zlab", config=zlab_config())
        dst = {"dst inside src": src / "out", "equal": src, "symlink to src": tmp_path / "link"}[layout]
        if layout == "symlink to src":
            dst.symlink_to(src, target_is_directory=True)
    refused_untouched(capsys, src, "overlaps the input", "convert", src, dst, "--overwrite")
    no_leftovers(Path(dst).resolve().parent)


def test_convert_overwrite_replaces_our_output_with_normal_permissions(tmp_path, capsys, umask022):
    cfg = {**WCFG, "d_model": 32, "d_embed": 32, "K": 7}
    save_pth(tmp_path / "w.pth", cfg, released_state_dict(cfg))
    src = write_zlab(tmp_path / "zlab", config=zlab_config())
    dst = tmp_path / "out"
    assert cli(capsys, "convert", tmp_path / "w.pth", dst)[0] == 0
    assert (dst / MARKER).is_file() and (dst / "config.json").is_file()
    assert dst.stat().st_mode & 0o777 == 0o755  # tempfile.mkdtemp would give 0o700
    (dst / "stale.txt").write_text("from the first run")
    code, _, err = cli(capsys, "convert", src, dst, "--overwrite")
    assert code == 0, err
    assert json.loads((dst / "config.json").read_text())["model_type"] == "dflash"
    assert not (dst / "stale.txt").exists() and (dst / MARKER).is_file()
    assert dst.stat().st_mode & 0o777 == 0o755
    no_leftovers(tmp_path)


def test_a_failed_write_leaves_the_old_output_as_it_was(tmp_path):
    with written_output(tmp_path / "out") as tmp:
        (tmp / "a.txt").write_text("first")
    before = snapshot(tmp_path / "out")
    with pytest.raises(RuntimeError, match="half way"):
        with written_output(tmp_path / "out", overwrite=True) as tmp:
            (tmp / "a.txt").write_text("second")
            raise RuntimeError("half way")
    assert snapshot(tmp_path / "out") == before
    no_leftovers(tmp_path)


def _failing_rename(monkeypatch, fails):
    """os.replace in output_dir raising for the renames ``fails(src, dst)`` picks: a crash between the renames."""
    import modeling_weaver.output_dir as od

    real = os.replace

    def replace(src, dst):
        if fails(Path(src), Path(dst)):
            raise OSError("disk gone")
        return real(src, dst)

    monkeypatch.setattr(od.os, "replace", replace)


@pytest.mark.parametrize("failing", ["new into place", "new into place and old back"])
def test_a_failed_rename_keeps_the_old_output(tmp_path, monkeypatch, failing):
    with written_output(tmp_path / "out") as tmp:
        (tmp / "a.txt").write_text("first")
    before = snapshot(tmp_path / "out")
    if failing == "new into place":
        _failing_rename(monkeypatch, lambda src, dst: ".tmp-" in src.name)
        with pytest.raises(OSError, match="disk gone"):
            with written_output(tmp_path / "out", overwrite=True) as tmp:
                (tmp / "a.txt").write_text("second")
        assert snapshot(tmp_path / "out") == before
        no_leftovers(tmp_path)
    else:  # the old output cannot go back either: it is kept where the error says
        _failing_rename(monkeypatch, lambda src, dst: dst.name == "out")
        with pytest.raises(OSError, match=r"the old output back: it is in .*\.out\.old-") as err:
            with written_output(tmp_path / "out", overwrite=True) as tmp:
                (tmp / "a.txt").write_text("second")
        kept = Path(str(err.value).rsplit("it is in ", 1)[1])
        assert snapshot(kept) == before


def test_a_failed_cleanup_leaves_the_new_output_complete(tmp_path, monkeypatch):
    import modeling_weaver.output_dir as od

    with written_output(tmp_path / "out") as tmp:
        (tmp / "a.txt").write_text("first")
    monkeypatch.setattr(od.shutil, "rmtree", lambda path, **k: (_ for _ in ()).throw(OSError("busy")))
    with pytest.raises(OSError, match="busy"):
        with written_output(tmp_path / "out", overwrite=True) as tmp:
            (tmp / "a.txt").write_text("second")
    assert (tmp_path / "out" / "a.txt").read_text() == "second" and (tmp_path / "out" / MARKER).is_file()


def test_partial_results_are_kept_only_when_asked(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with written_output(tmp_path / "res", keep_partial=True) as tmp:
            (tmp / "table.md").write_text("rows so far")
            raise KeyboardInterrupt
    assert (tmp_path / "res" / "table.md").read_text() == "rows so far" and is_our_output(tmp_path / "res")
    with pytest.raises(RuntimeError):
        with written_output(tmp_path / "empty", keep_partial=True):
            raise RuntimeError("nothing measured yet")
    assert not (tmp_path / "empty").exists()
    no_leftovers(tmp_path)


# ------------------------------------------------------------------------------------------ bench, replay, profile


def test_bench_refuses_an_unrelated_out_before_loading_anything(tmp_path, capsys):
    out = user_folder(tmp_path / "results")
    drafter = (tmp_path / "dflash")
    drafter.mkdir()  # empty: loading it would fail, so a refusal must come first
    argv = ["bench", "--target", tmp_path / "no-target", "--drafter", drafter, "--modes", "chain", "--no-plot",
            "--out", out]
    refused_untouched(capsys, out, "exists and is not empty: pass --overwrite", *argv)
    refused_untouched(capsys, out, "not a folder written by modeling-weaver", *argv, "--overwrite")
    refused_untouched(capsys, drafter, "overlaps the input", *argv[:-1], drafter / "results")


def test_replay_refuses_an_unrelated_out_and_a_trace_inside_it(tmp_path, capsys):
    out = user_folder(tmp_path / "results")
    refused_untouched(capsys, out, "exists and is not empty: pass --overwrite", "replay", "--synthetic-mal",
                      "chain=4", "--device", "cpu", "--out", out)
    (out / "results.json").write_text("{}")
    refused_untouched(capsys, out, "overlaps the input", "replay", "--trace", out / "results.json", "--out", out,
                      "--overwrite")


def _script(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_acceptance_profile_refuses_an_unrelated_out(tmp_path, capsys):
    out = user_folder(tmp_path / "profile")
    before = snapshot(out)
    with pytest.raises(SystemExit) as exit_info:
        _script("acceptance_profile").main(["--drafter", str(tmp_path), "--target", str(tmp_path / "none"),
                                            "--out", str(out)])
    assert exit_info.value.code == 2 and "argument --out" in capsys.readouterr().err
    assert snapshot(out) == before


def test_zoo_report_refuses_an_existing_png(tmp_path, capsys):
    (tmp_path / "ledger.jsonl").write_text("")
    (tmp_path / "curve.png").write_bytes(b"mine")
    with pytest.raises(SystemExit):
        _script("zoo_curve").main(["report", "--ledger", str(tmp_path / "ledger.jsonl"), "--png",
                                   str(tmp_path / "curve.png")])
    assert "pass --overwrite" in capsys.readouterr().err and (tmp_path / "curve.png").read_bytes() == b"mine"


# ------------------------------------------------------------------------------------------- make-data, training


@pytest.mark.parametrize("earlier", ["prompts-r0.jsonl", "manifest-r0.json", "shard-r0-00000.pt"])
def test_make_data_never_overwrites_an_earlier_runs_files(tmp_path, capsys, earlier):
    data = tmp_path / "data"
    data.mkdir()
    (data / earlier).write_text("an earlier run")
    (data / "prompts-r1.jsonl").write_text("another tag")
    refused_untouched(capsys, data, f"{data / earlier} already exists: make-data never overwrites an earlier run's "
                      "files; pass another --tag or --out", "make-data", "--target", tmp_path / "no-target",
                      "--out", data)


@pytest.mark.parametrize("command", ["train-dflash", "train-weaver"])
def test_a_fresh_training_run_refuses_a_used_folder(tmp_path, capsys, command):
    data = tmp_path / "data"
    data.mkdir()
    out = user_folder(tmp_path / "run")
    extra = ["--drafter", data] if command == "train-weaver" else []
    argv = [command, "--target", tmp_path / "no-target", "--data", data, *extra, "--device", "cpu"]
    refused_untouched(capsys, out, "exists and is not empty: choose another folder", *argv, "--output-dir", out)
    refused_untouched(capsys, data, "overlaps the input", *argv, "--output-dir", data / "run")


# -------------------------------------------------------------------------------------------------------- export


@pytest.fixture
def pair(tmp_path):
    target = tiny_qwen3()
    target.config.save_pretrained(tmp_path / "target")
    return write_zlab(tmp_path / "zlab", config=zlab_config()), tmp_path / "target", target.config


def test_export_refuses_an_unrelated_out_and_leaves_it_untouched(tmp_path, capsys, pair):
    dflash, target, _ = pair
    out = user_folder(tmp_path / "repo")
    refused_untouched(capsys, out, "not a folder written by modeling-weaver", "export", "--dflash", dflash,
                      "--target", target, "--out", out, "--overwrite")


def test_export_refuses_an_input_inside_out(tmp_path, capsys, pair):
    _, target, _ = pair
    out = tmp_path / "repo"
    assert cli(capsys, "export", "--dflash", pair[0], "--target", target, "--out", out)[0] == 0
    dflash = write_zlab(out / "zlab", config=zlab_config())
    refused_untouched(capsys, out, "overlaps the input", "export", "--dflash", dflash, "--target", target, "--out",
                      out, "--overwrite")


def test_export_overwrite_checks_everything_before_replacing(tmp_path, pair, umask022):
    dflash, _, target_config = pair
    drafter = load_dflash(dflash)
    out = export_pair(tmp_path / "repo", drafter, target_config=target_config, target_name="tiny/qwen3")
    assert (out / MARKER).is_file() and out.stat().st_mode & 0o777 == 0o755
    before = snapshot(out)
    with pytest.raises(ValueError, match="tree_budget"):
        export_pair(out, drafter, target_config=target_config, target_name="x", tree_budget=-3, overwrite=True)
    with pytest.raises(ValueError, match="does not match"):  # a pairing failure half way through the write
        export_pair(out, drafter, target_config=tiny_qwen3(vocab=50).config, target_name="x", overwrite=True)
    assert snapshot(out) == before
    export_pair(out, drafter, target_config=target_config, target_name="tiny/again", overwrite=True)
    assert json.loads((out / "speculative_config.json").read_text())["target_model"] == "tiny/again"
    no_leftovers(tmp_path)


def test_hub_configs_sync_replaces_only_marked_folders(tmp_path):
    name = "smollm2-135m-instruct"
    folder = tmp_path / name
    assert sync_hub_configs(root=tmp_path, names=[name])  # written fresh
    (folder / "README.md").write_text("edited")
    assert sync_hub_configs(root=tmp_path, names=[name]) == [f"{name}/README.md"]
    assert (folder / "README.md").read_text() != "edited" and (folder / MARKER).is_file()
    (folder / MARKER).unlink()
    (folder / "README.md").write_text("edited")
    before = snapshot(folder)
    with pytest.raises(FileExistsError, match="not a folder written by modeling-weaver"):
        sync_hub_configs(root=tmp_path, names=[name])
    assert snapshot(folder) == before


# ---------------------------------------------------------------------------------------------------- fetch-smollm2


@pytest.fixture
def fake_gguf_conversion(tmp_path, monkeypatch):
    """convert_gguf without the gguf extra or a real GGUF: transformers' loaders give objects that save a file."""
    import transformers

    def saver(name):
        return lambda folder: (Path(folder) / name).write_text(name)

    tokenizer = types.SimpleNamespace(chat_template="<|im_start|>", save_pretrained=saver("tokenizer.json"),
                                      convert_tokens_to_ids=lambda token: 2)
    model = types.SimpleNamespace(config=types.SimpleNamespace(), generation_config=types.SimpleNamespace(),
                                  save_pretrained=saver("model.safetensors"))
    monkeypatch.setattr("modeling_weaver.lab.smollm2.require", lambda *a, **k: None)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    return gguf


def test_fetch_refuses_an_unrelated_cache_dir_and_leaves_it_untouched(tmp_path, capsys, fake_gguf_conversion):
    cache = user_folder(tmp_path / "cache")
    refused_untouched(capsys, cache, "not a folder written by modeling-weaver", "fetch-smollm2", "--cache-dir", cache,
                      "--gguf", fake_gguf_conversion)


def test_fetch_writes_and_forces_only_its_own_cache(tmp_path, capsys, fake_gguf_conversion, umask022):
    cache = tmp_path / "cache"
    code, out, err = cli(capsys, "fetch-smollm2", "--cache-dir", cache, "--gguf", fake_gguf_conversion)
    assert code == 0, err
    assert (cache / MARKER).is_file() and (cache / "weaver_source.json").is_file()
    assert cache.stat().st_mode & 0o777 == 0o755
    assert cli(capsys, "fetch-smollm2", "--cache-dir", cache, "--gguf", fake_gguf_conversion, "--force")[0] == 0
    inside = cache / "model.gguf"  # the GGUF kept inside the cache it would replace
    inside.write_bytes(b"GGUF")
    refused_untouched(capsys, cache, "overlaps the input", "fetch-smollm2", "--cache-dir", cache, "--gguf", inside,
                      "--force")
    no_leftovers(tmp_path)


def test_fetch_split_writes_a_fresh_folder_and_refuses_an_unrelated_one(tmp_path, capsys, fake_gguf_conversion):
    split = user_folder(tmp_path / "parts")
    argv = ["fetch-smollm2", "--cache-dir", tmp_path / "cache", "--gguf", fake_gguf_conversion, "--split", split]
    refused_untouched(capsys, split, "exists and is not empty: pass --force", *argv)
    assert not (tmp_path / "cache").exists()  # refused before converting
    refused_untouched(capsys, split, "not a folder written by modeling-weaver (no .modeling_weaver_output file): "
                      "--force replaces only our own output", *argv, "--force")
    fresh = tmp_path / "fresh"
    assert cli(capsys, *argv[:-1], fresh, "--split-parts", "2")[0] == 0
    assert sorted(p.name for p in fresh.iterdir()) == [MARKER, "a", "b"]
    assert b"".join((fresh / d / "model.gguf.part{}".format(i)).read_bytes() for i, d in enumerate("ab")) == b"GGUF"
    assert cli(capsys, *argv[:-1], fresh, "--split-parts", "3", "--force")[0] == 0
    assert sorted(p.name for p in fresh.iterdir()) == [MARKER, "a", "b", "c"]
    no_leftovers(tmp_path)


# ------------------------------------------------------------------------------------------------------- loaders


def _dflash_folder(tmp_path) -> Path:
    config = DFlashConfig.from_target_config(tiny_qwen3().config, num_hidden_layers=1, block_size=4,
                                             target_layer_ids=[1])
    DFlashDraftModel(config).save_pretrained(tmp_path / "dflash")
    return tmp_path / "dflash"


def _drop(file: Path, field: str):
    raw = json.loads(file.read_text())
    if field == "rope_parameters.rope_theta":
        raw.pop("rope_parameters", None), raw.pop("rope_theta", None)
    else:
        raw.pop(field)
    file.write_text(json.dumps(raw))


def test_our_own_saved_configs_still_load(tmp_path):
    assert load_dflash(_dflash_folder(tmp_path)).config.rope_parameters["rope_theta"] == 10000.0
    assert load_dflash(write_zlab(tmp_path / "zlab")).config.rope_parameters["rope_theta"] == 1000000


@pytest.mark.parametrize("fmt", ["ours", "z-lab"])
@pytest.mark.parametrize("field", [*DFLASH_REQUIRED_FIELDS, "rope_parameters.rope_theta"])
def test_dflash_config_missing_a_field_is_refused_by_name(tmp_path, field, fmt):
    folder = _dflash_folder(tmp_path) if fmt == "ours" else write_zlab(tmp_path / "zlab")
    _drop(folder / "config.json", field)
    with pytest.raises(CheckpointError, match=rf"{folder / 'config.json'}: required field '{field}' is missing"):
        load_dflash(folder)


@pytest.mark.parametrize("field", WEAVER_REQUIRED_FIELDS)
def test_weaver_config_missing_a_field_is_refused_by_name(tmp_path, field):
    dconfig = DFlashConfig.from_target_config(tiny_qwen3().config, num_hidden_layers=1, block_size=4,
                                              target_layer_ids=[1])
    WeaverModel(WeaverConfig.from_target_config(tiny_qwen3().config, dconfig, d_rank=16, num_heads=2, mlp_dim=16,
                                                candidate_pool_size=8)).save_pretrained(tmp_path / "weaver")
    _drop(tmp_path / "weaver" / "config.json", field)
    with pytest.raises(CheckpointError, match=rf"weaver/config.json: required field '{field}' is missing"):
        load_weaver(tmp_path / "weaver")


def test_export_names_the_missing_field_in_one_line(tmp_path, capsys, pair):
    dflash, target, _ = pair
    _drop(dflash / "config.json", "rms_norm_eps")
    code, _, err = cli(capsys, "export", "--dflash", dflash, "--target", target, "--out", tmp_path / "repo")
    assert code == 1 and "required field 'rms_norm_eps' is missing" in err
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize("escape", ["../outside", "absolute", "symlink"])
def test_pair_repo_subfolders_stay_inside_the_repo(tmp_path, escape):
    outside = _dflash_folder(tmp_path / "elsewhere")  # a loadable drafter outside the repo
    repo = tmp_path / "repo"
    repo.mkdir()
    sub = {"../outside": os.path.relpath(outside, repo), "absolute": str(outside), "symlink": "dflash"}[escape]
    if escape == "symlink":
        (repo / "dflash").symlink_to(outside, target_is_directory=True)
    (repo / "speculative_config.json").write_text(json.dumps({"subfolders": {"dflash": sub}}))
    target = types.SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
    with pytest.raises(CheckpointError, match=r"speculative_config.json: subfolders.dflash = .* inside the repo"):
        resolve_drafters(target, str(repo), None)


def test_pair_repo_subfolder_inside_loads(tmp_path):
    repo = tmp_path / "repo"
    _dflash_folder(repo)
    (repo / "speculative_config.json").write_text(json.dumps({"subfolders": {"dflash": "dflash"}}))
    target = types.SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
    drafter, _, _ = resolve_drafters(target, str(repo), None)
    assert isinstance(drafter, DFlashDraftModel)


# ----------------------------------------------------------------------------------------------------------- flags


@pytest.mark.parametrize("argv, message", [
    (["demo", "--device", "foo"], "argument --device: 'foo' is not a torch device"),
    (["demo", "--device", "cuda:999"], "argument --device: 'cuda:999'"),
    (["demo", "--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
    (["demo", "--tree-budget", "0"], "argument --tree-budget: must be >= 1, got 0"),
    (["demo", "--tree-budget", "many"], "argument --tree-budget: expected a whole number >= 1"),
    (["export", "--tree-budget", "-3"], "argument --tree-budget: must be >= 1, got -3"),
    (["bench", "--budgets", "16", "0"], "argument --budgets: must be >= 1, got 0"),
    (["bench", "--max-new-tokens", "-1"], "argument --max-new-tokens: must be >= 1"),
    (["bench", "--device", "foo"], "argument --device"),
    (["replay", "--budgets", "-4"], "argument --budgets: must be >= 1"),
    (["replay", "--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1"),
    (["replay", "--device", "foo"], "argument --device"),
    (["train-dflash", "--device", "foo"], "argument --device"),
    (["train-weaver", "--device", "foo"], "argument --device"),
    (["make-data", "--device", "foo"], "argument --device"),
    (["make-data", "--num-samples", "0"], "argument --num-samples: must be >= 1, got 0"),
    (["make-data", "--exclude-prompts", "/no/such.jsonl"], "argument --exclude-prompts: '/no/such.jsonl' is not a"),
    (["train-dflash", "--batch-size", "0"], "argument --batch-size: must be >= 1"),
    (["train-dflash", "--log-every", "0"], "argument --log-every: must be >= 1"),
    (["train-dflash", "--save-every", "-1"], "argument --save-every: must be >= 0"),
    (["train-dflash", "--data", "/no/such/dir"], "argument --data: '/no/such/dir' is not a folder"),
    (["train-weaver", "--drafter", "/no/such/dir"], "argument --drafter: '/no/such/dir' is not a folder"),
    (["train-weaver", "--pool", "0"], "argument --pool: must be >= 1"),
    (["replay", "--trace", "/no/such.json"], "argument --trace: '/no/such.json' is not a file"),
    (["replay", "--hf-tokens", "-1"], "argument --hf-tokens: must be >= 0"),
    (["bench", "--subset", "0"], "argument --subset: must be >= 1"),
    (["bench", "--drafter", "/no/such/dir"], "argument --drafter: '/no/such/dir' is not a folder"),
    (["fetch-smollm2", "--split-parts", "0"], "argument --split-parts: must be >= 1"),
    (["fetch-smollm2", "--split-parts", "27"], "argument --split-parts: must be <= 26"),
    (["fetch-smollm2", "--gguf", "/no/such.gguf"], "argument --gguf: '/no/such.gguf' is not a file"),
])
def test_bad_flags_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser(argv[0]).parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_good_device_flags_pass():
    args = build_parser("demo").parse_args(["demo", "--device", "cpu", "--max-new-tokens", "1", "--tree-budget", "1"])
    assert (args.device, args.max_new_tokens, args.tree_budget) == ("cpu", 1, 1)


@pytest.mark.parametrize("argv, message", [
    (["--drafter", ".", "--device", "foo"], "argument --device: 'foo' is not a torch device"),
    (["--drafter", ".", "--max-new-tokens", "1"], "argument --max-new-tokens: must be >= 2, got 1"),
    (["--drafter", ".", "--subset", "0"], "argument --subset: must be >= 1"),
    (["--drafter", "/no/such/dir"], "argument --drafter: '/no/such/dir' is not a folder"),
])
def test_acceptance_profile_flags_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _script("acceptance_profile").main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err

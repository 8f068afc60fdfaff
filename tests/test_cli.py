"""The ``weaver`` command line: every subcommand's --help, one tiny real invocation each, one-line failures."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_hub import WCFG, released_state_dict, save_pth, write_zlab
from tiny_targets import tiny_qwen3

from modeling_weaver.cli import LAZY_COMMANDS, LOCAL_COMMANDS, ORDER, build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str, command: str) -> str:
    """The failure is one line, and the last one (progress bars of work done before may precede it)."""
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith((f"weaver {command}: error: ", "error: "))]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    return errors[0]


def module_available(command: str) -> bool:
    module = LAZY_COMMANDS[command][0]
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name == module:
            return False
        raise
    return True


def test_top_level_help_imports_no_subcommand_module():
    """`weaver --help` (a fresh interpreter) lists every command without importing the modules behind them."""
    code = ("import json, sys, contextlib, io, modeling_weaver.cli as c\n"
            "buf = io.StringIO()\n"
            "with contextlib.redirect_stdout(buf):\n"
            "    try:\n"
            "        c.main(['--help'])\n"
            "    except SystemExit as e:\n"
            "        assert e.code == 0\n"
            "lazy = sorted(m for m in sys.modules if m in {v[0] for v in c.LAZY_COMMANDS.values()})\n"
            "print(json.dumps({'help': buf.getvalue(), 'imported': lazy}))\n")
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                    check=True).stdout.strip().splitlines()[-1])
    assert out["imported"] == []
    for name in ORDER:
        assert name in out["help"], name


@pytest.mark.parametrize("command", ORDER)
def test_every_subcommand_explains_itself(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: weaver {command}")
    description = (LOCAL_COMMANDS.get(command) or LAZY_COMMANDS[command])[3]
    # the module may set its own (longer) description; either way the command says what it does
    assert len(out.split("\n\n")[1].split()) >= 10, out
    if command in LAZY_COMMANDS and not module_available(command):
        assert "Unavailable:" in out and description.split()[0] in out


def test_no_command_prints_help(capsys):
    code, out, _ = run(capsys)
    assert code == 2 and "COMMAND" in out


def test_unknown_option_exits_nonzero(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "--no-such-flag"])
    assert exit_info.value.code == 2


# ----------------------------------------------------------------------------------------------------------- demo


def test_demo_tiny_runs_end_to_end(capsys):
    code, out, err = run(capsys, "demo", "--tiny", "--max-new-tokens", "12", "--tree-budget", "8")
    assert code == 0, err
    assert "identical to AR: yes" in out and "mean accepted length (MAL)" in out and "speed-up" in out
    assert "linears packed" in out  # on CPU the demo runs both paths on prepacked linears (pack_cpu_linears)


def test_demo_tiny_with_auto_warms_every_size(tmp_path, monkeypatch, capsys):
    """``--tree-budget auto`` without ``--mode`` (the default mode): the warm-up verifies every size auto may choose
    (budget.warm_sizes) before the timed runs, and the demo reports its sizes."""
    from modeling_weaver.decoding import budget

    monkeypatch.setenv("MODELING_WEAVER_CACHE", str(tmp_path))
    warmed = []
    warm = budget.warm_sizes
    monkeypatch.setattr(budget, "warm_sizes", lambda *a, **k: warmed.append(a[3]) or warm(*a, **k))
    code, out, err = run(capsys, "demo", "--tiny", "--max-new-tokens", "12", "--tree-budget", "auto")
    assert code == 0, err
    assert warmed == [None] and "identical to AR: yes" in out and "tree sizes" in out


def test_demo_without_shipped_drafters_fails_in_one_line(tmp_path, capsys):
    code, _, err = run(capsys, "demo", "--drafters", str(tmp_path / "nothing"))
    assert code == 1
    assert "no trained drafters" in one_line_error(err, "demo")


# -------------------------------------------------------------------------------------------------- convert / export


def test_convert_zlab_and_weaver_then_export(tmp_path, capsys):
    from test_hub import zlab_config

    write_zlab(tmp_path / "zlab", config=zlab_config())
    code, out, err = run(capsys, "convert", str(tmp_path / "zlab"), str(tmp_path / "dflash"))
    assert code == 0, err and "DFlash drafter" in out
    assert json.loads((tmp_path / "dflash" / "config.json").read_text())["model_type"] == "dflash"

    cfg = {**WCFG, "d_model": 32, "d_embed": 32, "K": 7}
    save_pth(tmp_path / "w.pth", cfg, released_state_dict(cfg))
    code, out, err = run(capsys, "convert", str(tmp_path / "w.pth"), str(tmp_path / "weaver"), "--dtype", "fp32")
    assert code == 0, err
    assert "Weaver" in out and (tmp_path / "weaver" / "model.safetensors").exists()

    code, _, err = run(capsys, "convert", str(tmp_path / "w.pth"), str(tmp_path / "weaver"))
    assert code == 1 and "exists" in one_line_error(err, "convert")

    target = tiny_qwen3()
    target.save_pretrained(tmp_path / "target")
    card = tmp_path / "card.json"
    card.write_text(json.dumps({"results_command": "weaver bench --subset 4"}))
    code, out, err = run(capsys, "export", "--dflash", str(tmp_path / "dflash"), "--weaver", str(tmp_path / "weaver"),
                         "--target", str(tmp_path / "target"), "--target-name", "tiny/qwen3", "--out",
                         str(tmp_path / "repo"), "--card", str(card), "--dtype", "bf16")
    assert code == 0, err
    assert "[TO FILL]" in out  # the unfinished card is pointed out
    spec = json.loads((tmp_path / "repo" / "speculative_config.json").read_text())
    # no --mode / --tree-budget: none written, the device's defaults apply at generation time
    assert spec["target_model"] == "tiny/qwen3" and spec["generation_defaults"] == {"mode": None,
                                                                                   "tree_budget": None}
    assert "the device's mode (weaver on CUDA, ddtree on CPU)" in (tmp_path / "repo" / "README.md").read_text()
    assert "weaver bench --subset 4" in (tmp_path / "repo" / "README.md").read_text()


def test_convert_and_export_failures_are_one_line(tmp_path, capsys):
    bad = released_state_dict()
    bad.pop("out_norm.bias")
    save_pth(tmp_path / "bad.pth", WCFG, bad)
    code, _, err = run(capsys, "convert", str(tmp_path / "bad.pth"), str(tmp_path / "o"))
    assert code == 1 and "missing tensor 'out_norm.bias'" in one_line_error(err, "convert")

    code, _, err = run(capsys, "convert", str(tmp_path / "missing"), str(tmp_path / "o"))
    assert code == 1 and "does not exist" in one_line_error(err, "convert")

    code, _, err = run(capsys, "export", "--out", str(tmp_path / "x"))
    assert code == 1 and "missing --dflash, --target" in one_line_error(err, "export")

    # a drafter for another target is refused before anything is written
    write_zlab(tmp_path / "zlab")
    other = tiny_qwen3(vocab=50)
    other.config.save_pretrained(tmp_path / "other")
    code, _, err = run(capsys, "export", "--dflash", str(tmp_path / "zlab"), "--target", str(tmp_path / "other"),
                       "--out", str(tmp_path / "repo"))
    assert code == 1 and "vocab_size 97 does not match" in one_line_error(err, "export")
    assert not (tmp_path / "repo").exists()


def test_export_hub_configs_check(capsys):
    code, out, err = run(capsys, "export", "--hub-configs", "--check")
    assert code == 0, err
    assert "in sync" in out


# ------------------------------------------------------------------------------ subcommands backed by other modules


def _tiny_target_dir(tmp_path):
    try:
        from test_data import save_tiny_target
    except ImportError as err:  # pragma: no cover - depends on the data tests being present
        pytest.skip(f"tests/test_data.py (tiny chat target helper) is not available: {err}")
    return save_tiny_target(tmp_path / "target")


def _offline_leak_checker(monkeypatch):
    from modeling_weaver.lab.data import LeakChecker

    eval_prompts = {"mtbench/81": "Compose an engaging travel blog post about a recent trip to Hawaii."}
    monkeypatch.setattr("modeling_weaver.lab.data.LeakChecker", lambda **kw: LeakChecker(eval_prompts, **kw))


def test_bench_tiny(tmp_path, capsys):
    if not module_available("bench"):
        pytest.skip("modeling_weaver.lab.benchmark is not in this tree; `weaver bench` then fails in one line "
                    "(test_unavailable_module_fails_in_one_line)")
    from transformers import AutoConfig

    from modeling_weaver import DFlashConfig, DFlashDraftModel, WeaverConfig, WeaverModel

    target = _tiny_target_dir(tmp_path)
    config = AutoConfig.from_pretrained(target)
    torch.manual_seed(0)
    dconfig = DFlashConfig.from_target_config(config, num_hidden_layers=1, block_size=4, target_layer_ids=[1])
    DFlashDraftModel(dconfig).save_pretrained(tmp_path / "dflash")
    WeaverModel(WeaverConfig.from_target_config(config, dconfig, d_rank=16, num_heads=2, mlp_dim=16,
                                                candidate_pool_size=8)).save_pretrained(tmp_path / "weaver")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"dataset": "toy", "id": str(i), "prompt": text})
                                 for i, text in enumerate(("hello there", "write code"))) + "\n")
    code, out, err = run(capsys, "bench", "--target", str(target), "--drafter", str(tmp_path / "dflash"),
                         "--weaver", str(tmp_path / "weaver"), "--prompts", str(prompts), "--modes", "chain",
                         "weaver", "--budgets", "4", "--temperatures", "0", "--max-new-tokens", "8", "--out",
                         str(tmp_path / "bench"), "--no-plot", "--strict", "--no-progress", "--device", "cpu")
    assert code == 0, err
    assert (tmp_path / "bench" / "table.md").exists()



def test_bench_budgets_default_to_the_devices():
    """No --budgets: 16 32 64 on CUDA, the device's default budget on a CPU (where larger trees cost more)."""
    import torch

    from modeling_weaver.cli import build_parser
    from modeling_weaver.lab.benchmark import default_budgets
    from modeling_weaver.tree import default_tree_budget

    assert build_parser("bench").parse_args(["bench"]).budgets is None
    assert default_budgets("cpu") == [default_tree_budget("cpu")] == [5]
    assert default_budgets(torch.device("cuda", 0)) == [16, 32, 64]


def test_unavailable_module_fails_in_one_line(capsys, monkeypatch):
    monkeypatch.setitem(LAZY_COMMANDS, "bench", ("modeling_weaver._no_such_module",) + LAZY_COMMANDS["bench"][1:])
    code, _, err = run(capsys, "bench", "--anything")
    assert code == 1 and "not available in this install" in one_line_error(err, "bench")
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0 and "Unavailable:" in capsys.readouterr().out


def test_make_data_then_train_dflash_then_train_weaver_tiny(tmp_path, capsys, monkeypatch):
    for command in ("make-data", "train-dflash", "train-weaver"):
        if not module_available(command):
            pytest.skip(f"{LAZY_COMMANDS[command][0]} is not in this tree yet")
    target = _tiny_target_dir(tmp_path)
    _offline_leak_checker(monkeypatch)
    data = tmp_path / "data"
    code, _, err = run(capsys, "make-data", "--target", str(target), "--out", str(data), "--num-samples", "4",
                       "--batch-size", "4", "--max-prompt-tokens", "8", "--max-response-tokens", "12",
                       "--min-prompt-words", "0", "--no-progress", "--device", "cpu")
    assert code == 0, err
    common = ["--target", str(target), "--data", str(data), "--max-steps", "2", "--batch-size", "2", "--anchors", "4",
              "--no-progress", "--device", "cpu", "--save-every", "0", "--max-length", "64"]
    code, _, err = run(capsys, "train-dflash", *common, "--output-dir", str(tmp_path / "dflash"), "--num-layers", "2",
                       "--block-size", "4", "--target-layer-ids", "0", "1")
    assert code == 0, err
    assert (tmp_path / "dflash" / "config.json").exists()
    code, _, err = run(capsys, "train-weaver", *common, "--output-dir", str(tmp_path / "weaver"), "--drafter",
                       str(tmp_path / "dflash"), "--pool", "8")
    assert code == 0, err
    # and the trained pair exports into a Hub repo
    code, _, err = run(capsys, "export", "--dflash", str(tmp_path / "dflash"), "--weaver", str(tmp_path / "weaver"),
                       "--target", str(target), "--target-name", "tiny/llama", "--out", str(tmp_path / "repo"))
    assert code == 0, err
    # the exported pair runs in the demo path's generator and is lossless
    from modeling_weaver.convert import load_dflash, load_weaver
    from modeling_weaver.generate import speculative_generate
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target).eval()
    ids = torch.tensor([[2, 40, 41, 42]])
    got = speculative_generate(model, ids, drafter=load_dflash(tmp_path / "repo" / "dflash"),
                               weaver=load_weaver(tmp_path / "repo" / "weaver"), tree_budget=8, max_new_tokens=12,
                               eos_token_id=[])
    assert torch.equal(got, model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                           max_new_tokens=12, min_new_tokens=0, eos_token_id=None, pad_token_id=0))


def test_train_failure_is_one_line(tmp_path, capsys):
    if not module_available("train-dflash"):
        pytest.skip("modeling_weaver.lab.training is not in this tree yet")
    code, _, err = run(capsys, "train-dflash", "--target", str(tmp_path / "missing"), "--data", str(tmp_path),
                       "--output-dir", str(tmp_path / "o"), "--device", "cpu")
    assert code == 1
    one_line_error(err, "train-dflash")


def test_fetch_smollm2_from_cache(capsys):
    if not module_available("fetch-smollm2"):
        pytest.skip("modeling_weaver.lab.smollm2 is not in this tree yet")
    smollm2 = importlib.import_module("modeling_weaver.lab.smollm2")
    if not smollm2.is_cached():
        pytest.skip("SmolLM2-135M-Instruct is not cached here (fetching it downloads 93 MB); run `weaver fetch`")
    code, out, err = run(capsys, "fetch", "--cache-dir", str(smollm2.default_cache_dir()))
    assert code == 0, err
    assert "cached at" in out


def test_build_parser_only_imports_the_selected_module():
    parser = build_parser("convert")
    assert "convert" in parser.format_help()


@pytest.mark.parametrize("args", [["convert", "--help"], ["export", "--help"]])
def test_module_entry_is_the_cli(args):
    # `python -m modeling_weaver.cli` is how torchrun and scripts/train_smollm2.sh start a command
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "kernels")])}
    proc = subprocess.run([sys.executable, "-m", "modeling_weaver.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage: weaver" in proc.stdout


def test_convert_kind_weaver_converts(tmp_path, capsys):
    save_pth(tmp_path / "w.pth", WCFG, released_state_dict())
    code, _, err = run(capsys, "convert", "--kind", "weaver", str(tmp_path / "w.pth"), str(tmp_path / "out"))
    assert code == 0 and (tmp_path / "out" / "model.safetensors").exists(), err

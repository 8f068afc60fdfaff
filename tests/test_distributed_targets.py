"""Targets spread over processes or devices (issue #33): transformers' tensor parallelism (``tp_plan="auto"``, two
gloo ranks on CPU) and accelerate's ``device_map`` dispatch; the loop runs on them unchanged and stays lossless."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_generate import make_drafters, prompts, reference
from tiny_targets import tiny_qwen3, tiny_qwen3_5

from modeling_weaver import speculative_generate

ROOT = Path(__file__).resolve().parents[1]


def _tp_run(target, tmp_path: Path) -> list[dict]:
    """``tests/tp_worker.py`` on ``target`` (saved first) as two gloo ranks under torchrun; each rank's report."""
    target.save_pretrained(tmp_path / "target")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "kernels")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "tp_worker.py"), str(tmp_path / "target"), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_tensor_parallel_target_is_lossless(family, tmp_path):
    """A tiny Qwen3 (attention) and Qwen3.5 (hybrid GDN + gated attention) target loaded with ``tp_plan="auto"`` on two
    ranks: its k/v projections hold half the rows on each rank and our attention caches half the KV heads; greedy
    output in every mode (and through ``generate(custom_generate=...)``) equals ``target.generate``'s on that same
    split target, and equals the one-process greedy output; sampling with one seed gives every rank the same text
    (the ranks never disagree about a tree or a token)."""
    target = {"qwen3": tiny_qwen3, "qwen3_5": tiny_qwen3_5}[family]()
    ranks = _tp_run(target, tmp_path)
    single = reference(target, torch.tensor([[5, 9, 17, 3, 44, 21, 8]]), 48)[0].tolist()
    for seen in ranks:
        assert seen["world"] == 2 and seen["k_proj"] == "DTensor"
        assert seen["k_local_rows"] * 2 == seen["k_rows"]
        assert seen["kv_heads_here"] * 2 == seen["kv_heads"]
        assert seen["identical"] == {"chain": True, "ddtree": True, "weaver": True, "custom_generate": True}
        assert seen["greedy"] == single
    assert ranks[0]["sampled"] == ranks[1]["sampled"] and len(ranks[0]["sampled"]) == len(single)

"""Targets spread over processes or devices (issue #33): transformers' tensor parallelism (``tp_plan="auto"``, two
gloo ranks on CPU) and accelerate's ``device_map`` dispatch; the loop runs on them unchanged and stays lossless."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_generate import make_drafters, prompts, reference
from tiny_targets import tiny_qwen3, tiny_qwen3_5

from modeling_weaver import speculative_generate

ROOT = Path(__file__).resolve().parents[1]


def _dump(stderr: str) -> str:
    """The launcher's stderr for a failure message: a rank's fatal-signal dump (faulthandler) wherever it is, since
    the other rank's traceback usually follows it, then the end."""
    at = stderr.find("Fatal Python error")
    return (stderr[at:at + 3000] + "\n...\n" if at >= 0 else "") + stderr[-4000:]


def _tp_run(target, tmp_path: Path) -> list[dict]:
    """``tests/tp_worker.py`` on ``target`` (saved first) as two gloo ranks under torchrun; each rank's report."""
    target.save_pretrained(tmp_path / "target")
    # faulthandler: a rank killed by a signal prints where it was (rank 0 has rarely aborted right after loading)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "kernels")]),
           "PYTHONFAULTHANDLER": "1", "TORCH_SHOW_CPP_STACKTRACES": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "tp_worker.py"), str(tmp_path / "target"), str(tmp_path)]
    # its own process group: a rank stuck in a collective is killed with the launcher, not left behind
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail("the two ranks did not finish in 300 s (a collective one rank never reached?):\n" + _dump(stderr))
    assert proc.returncode == 0, stdout[-2000:] + _dump(stderr)
    return [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_tensor_parallel_target_is_lossless(family, tmp_path):
    """A tiny Qwen3 (attention) and Qwen3.5 (hybrid GDN + gated attention) target loaded with ``tp_plan="auto"`` on two
    ranks: its k/v projections hold half the rows on each rank and our attention caches half the KV heads; greedy
    output in every mode (the drafter replicated, or on rank 0 with the tree broadcast; and through
    ``generate(custom_generate=...)``) equals ``target.generate``'s on that same split target, and equals the one-process greedy output; sampling with one seed gives every rank the same text
    (the ranks never disagree about a tree or a token)."""
    target = {"qwen3": tiny_qwen3, "qwen3_5": tiny_qwen3_5}[family]()
    ranks = _tp_run(target, tmp_path)
    single = reference(target, torch.tensor([[5, 9, 17, 3, 44, 21, 8]]), 48)[0].tolist()
    for seen in ranks:
        assert seen["world"] == 2 and seen["k_proj"] == "DTensor"
        assert seen["k_local_rows"] * 2 == seen["k_rows"]
        assert seen["kv_heads_here"] * 2 == seen["kv_heads"]
        assert seen["identical"] == {"chain": True, "ddtree": True, "weaver": True, "ddtree rank0": True,
                                     "weaver rank0": True, "custom_generate": True}
        assert seen["greedy"] == single
    assert ranks[0]["drafter_calls_rank0"] > 0 and ranks[1]["drafter_calls_rank0"] == 0  # (rank 1 only received)
    assert ranks[0]["sampled"] == ranks[1]["sampled"] and len(ranks[0]["sampled"]) == len(single)


def test_tp_drafter_choice_is_checked_and_needs_ranks():
    """``StepOptions.tp_drafter`` takes "replicated" or "rank0" (anything else is refused by name); in one process
    (no process group) "rank0" changes nothing."""
    from modeling_weaver.options import StepOptions

    with pytest.raises(ValueError, match="tp_drafter"):
        StepOptions(tp_drafter="rank1")
    target = tiny_qwen3()
    drafter, weaver = make_drafters(target)
    ids = prompts(2)[1]
    out = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode="weaver", max_new_tokens=24,
                               step_options=StepOptions(tp_drafter="rank0"))
    assert torch.equal(out, reference(target, ids, 24))


def _split_map(target, devices) -> dict:
    """A device_map that puts the embedding and the first layers on ``devices[0]`` and the rest, the final norm and
    lm_head on ``devices[1]`` (the rotary embedding with the first)."""
    n = len(target.model.layers)
    cut = n // 2
    placement = {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0], "model.norm": devices[1],
                 "lm_head": devices[1]}
    placement.update({f"model.layers.{i}": devices[0] if i < cut else devices[1] for i in range(n)})
    return placement


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_accelerate_dispatched_target_is_lossless(family):
    """A target dispatched by accelerate (its alignment hooks on every layer, as ``device_map`` loading installs
    them; here every layer on the CPU): the adapter calls the hooked modules as they are, and every mode stays
    token-identical to ``target.generate``."""
    from accelerate import dispatch_model

    target = {"qwen3": tiny_qwen3, "qwen3_5": tiny_qwen3_5}[family]()
    drafter, weaver = make_drafters(target)
    ids = prompts(3)[2]
    expected = reference(target, ids, 40)
    dispatch_model(target, _split_map(target, ["cpu", "cpu"]), force_hooks=True)
    assert hasattr(target.model.layers[0], "_hf_hook")
    for mode in ("chain", "ddtree", "weaver"):
        out = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget=12,
                                   max_new_tokens=40)
        assert torch.equal(out, expected), mode


def test_offloaded_target_is_refused_by_name(tmp_path):
    """Layers that accelerate offloads to disk (weights on the meta device, fetched by a hook at each call) are refused
    with an error that says so and what to do, before any step runs."""
    from accelerate import dispatch_model

    target = tiny_qwen3()
    drafter, weaver = make_drafters(target)
    placement = _split_map(target, ["cpu", "cpu"])
    placement["model.layers.2"] = "disk"
    dispatch_model(target, placement, offload_dir=str(tmp_path))
    assert target.model.layers[2].mlp.gate_proj.weight.is_meta
    with pytest.raises(ValueError, match="offloaded by accelerate.*model.layers.2"):
        speculative_generate(target, prompts(1)[0], drafter=drafter, weaver=weaver, max_new_tokens=4)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("drafter_on", [0, 1])
def test_device_map_target_over_two_gpus_is_lossless(family, drafter_on):
    """A target split over two GPUs (embedding and first layers on cuda:0, the rest and lm_head on cuda:1): the
    eager loop runs each layer and its cache on its own device, with the drafter and Weaver on either GPU, and every
    mode is token-identical to ``target.generate`` on that split target; fixed-shape
    steps are refused by name; a prompt away from the embedding and a Weaver away from its drafter are refused."""
    from accelerate import dispatch_model

    target = {"qwen3": tiny_qwen3, "qwen3_5": tiny_qwen3_5}[family]()
    drafter, weaver = make_drafters(target)
    dispatch_model(target, _split_map(target, ["cuda:0", "cuda:1"]))
    assert {p.device.index for p in target.parameters()} == {0, 1}
    ids = prompts(3)[2].to("cuda:0")
    expected = reference(target, ids, 48)
    drafter, weaver = drafter.to(f"cuda:{drafter_on}"), weaver.to(f"cuda:{drafter_on}")
    for mode in ("chain", "ddtree", "weaver"):
        out = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget=12,
                                   max_new_tokens=48)
        assert torch.equal(out, expected), mode
    with pytest.raises(ValueError, match="target_step"):
        speculative_generate(target, ids, drafter=drafter, weaver=weaver, target_step="graph", max_new_tokens=4)
    with pytest.raises(ValueError, match="input embedding"):
        speculative_generate(target, ids.to("cuda:1"), drafter=drafter, weaver=weaver, max_new_tokens=4)
    with pytest.raises(ValueError, match="one device"):
        speculative_generate(target, ids, drafter=drafter, weaver=weaver.to(f"cuda:{1 - drafter_on}"), mode="weaver",
                             max_new_tokens=4)

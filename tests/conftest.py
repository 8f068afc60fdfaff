import os

import pytest
import torch

# The models under test are tiny: one thread avoids oversubscribing CI's two cores (and is faster at these sizes).
torch.set_num_threads(1)

WORKERS = 2  # CI's cores: each worker runs single-threaded tests


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """`pytest` runs on two pytest-xdist workers, whole files each (module fixtures built once, file order kept),
    where xdist is installed (the `test` extra) and no `-n` is given; `-n 0`, and `-m gpu` runs, stay in this
    process."""
    if os.environ.get("PYTEST_XDIST_WORKER") or hasattr(config, "workerinput"):
        return  # a worker itself
    if not config.pluginmanager.hasplugin("xdist") or config.getoption("numprocesses", None) is not None:
        return
    if config.getoption("usepdb", False) or config.getoption("collectonly", False):
        return
    if "gpu" in (config.getoption("markexpr", "") or "").replace("not gpu", ""):
        return  # GPU tests share one device: one process (the GPU machine may lack xdist anyway)
    config.option.numprocesses = WORKERS
    if config.option.dist == "no":
        config.option.dist = "loadfile"

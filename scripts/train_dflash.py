#!/usr/bin/env python
"""Train a DFlash block drafter for a frozen target.

Thin wrapper over modeling_weaver.training; `--help` lists every flag.

Single process: python scripts/train_dflash.py ...   DDP: torchrun --nproc_per_node N scripts/train_dflash.py ...
"""

import argparse
import sys
from pathlib import Path

try:
    import modeling_weaver  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(root), str(root / "kernels")]

from modeling_weaver.training import add_train_dflash_arguments, run_train_dflash


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="train_dflash.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    return run_train_dflash(add_train_dflash_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

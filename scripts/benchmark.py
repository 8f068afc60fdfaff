#!/usr/bin/env python
"""Benchmark AR vs chain / DDTree / Weaver trees on MT-Bench and HumanEval.

Thin wrapper over modeling_weaver.benchmark; `--help` lists every flag.
"""

import argparse
import sys
from pathlib import Path

try:
    import modeling_weaver  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(root), str(root / "kernels")]

from modeling_weaver.benchmark import add_benchmark_arguments, run_benchmark


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmark.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    return run_benchmark(add_benchmark_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

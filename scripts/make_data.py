#!/usr/bin/env python
"""Generate drafter training data with the target itself.

Thin wrapper over modeling_weaver.data; `--help` lists every flag.
"""

import argparse
import sys
from pathlib import Path

try:
    import modeling_weaver  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(root), str(root / "kernels")]

from modeling_weaver.data import add_make_data_arguments, run_make_data


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="make_data.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    return run_make_data(add_make_data_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

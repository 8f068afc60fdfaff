#!/usr/bin/env python
"""Convert the paper's Weaver release (``.pth`` dict ``{"config", "state_dict"}``) into our Hub layout.

    python scripts/convert_weaver.py weaver.pth out/weaver [--dtype bf16]

Every config field is mapped to ``WeaverConfig`` and every tensor name and shape is checked; the older variant
(separate q/k/v projections, GELU MLP, learned pos_emb) is refused by name. Same as ``weaver convert --kind weaver``;
``weaver convert`` also converts z-lab DFlash checkpoints.
"""

import sys
from pathlib import Path

try:
    import modeling_weaver  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(root), str(root / "kernels")]

from modeling_weaver.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "--kind", "weaver", *sys.argv[1:]]))

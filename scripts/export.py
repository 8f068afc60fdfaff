#!/usr/bin/env python
"""Assemble a Hub repo folder for a trained drafter pair, or regenerate ``hub_configs/``.

    python scripts/export.py --dflash runs/dflash --weaver runs/weaver --target path/to/target \
        --target-name HuggingFaceTB/SmolLM2-135M-Instruct --out export/smollm2-135m-instruct-weaver --card card.json
    python scripts/export.py --hub-configs [--check]

Same as ``weaver export``: dflash/ and weaver/ (configs, code, safetensors), custom_generate/, speculative_config.json
and a model card rendered from MODEL_CARD.md, after checking the pair against the target's config.
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
    sys.exit(main(["export", *sys.argv[1:]]))

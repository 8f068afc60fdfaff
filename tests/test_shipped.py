"""The shipped SmolLM2-135M-Instruct drafters (``checkpoints/smollm2-135m-instruct``): Hub layout, loading through
``AutoModel.from_pretrained(..., trust_remote_code=True)``, pairing, code in sync with the package. The check on the
real target (identity and acceptance) is in test_smollm2.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModel

from modeling_weaver import DFlashDraftModel, WeaverModel
from modeling_weaver.export import HUB_SPECS
from modeling_weaver.pairing import check_pair

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "checkpoints" / "smollm2-135m-instruct"
PACKAGE = ROOT / "modeling_weaver"


@pytest.mark.parametrize("sub, cls", [("dflash", "DFlashDraftModel"), ("weaver", "WeaverModel")])
def test_shipped_checkpoints_load_with_automodel(sub, cls):
    model = AutoModel.from_pretrained(SHIPPED / sub, trust_remote_code=True)
    assert type(model).__name__ == cls
    assert model.dtype == torch.bfloat16
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # the same weights through the package's own classes
    ours = {"dflash": DFlashDraftModel, "weaver": WeaverModel}[sub].from_pretrained(SHIPPED / sub)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ours.state_dict().values()))


def test_shipped_pair_matches_smollm2_and_is_small():
    drafter = DFlashDraftModel.from_pretrained(SHIPPED / "dflash")
    weaver = WeaverModel.from_pretrained(SHIPPED / "weaver")
    check_pair(HUB_SPECS["smollm2-135m-instruct"].target(), drafter.config, weaver.config)
    spec = json.loads((SHIPPED / "speculative_config.json").read_text())
    assert spec["target_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert spec["generation_defaults"] == {"mode": None, "tree_budget": None}  # (the device's at generation time)
    size = sum(f.stat().st_size for f in SHIPPED.rglob("*.safetensors"))
    assert size < 40 * 2**20, size
    assert "[TO FILL" not in (SHIPPED / "README.md").read_text()


def _copy_of(path: Path, source: Path) -> bool:
    """``path`` is ``source`` under the one-line do-not-edit banner that names it."""
    name = source.relative_to(ROOT).as_posix()
    banner = f"# Generated from {name} — do not edit; edit the source and run `weaver export`.\n"
    return path.read_text(encoding="utf-8") == banner + source.read_text(encoding="utf-8")


def test_shipped_code_is_the_package_code():
    """Remote code in the shipped folder is a copy of the package's modeling files under a do-not-edit line
    (re-export after changing them: README, 'Shipped drafters')."""
    copies = [p for p in SHIPPED.rglob("*.py") if p.parent.name != "custom_generate"]
    assert copies
    stale = [str(p.relative_to(ROOT)) for p in copies if not _copy_of(p, PACKAGE / p.name)]
    assert not stale, stale
    recipe = ROOT / "custom_generate"
    shipped = [p for p in (SHIPPED / "custom_generate").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    stale = [str(p.relative_to(SHIPPED)) for p in shipped if not _copy_of(p, recipe / p.name)]
    assert shipped and not stale, stale

"""Hub repositories for drafter pairs: pairing checks, repo assembly, ``hub_configs/`` and ``custom_generate``.

One Hub repo holds one drafter pair for one target::

    <repo>/
      README.md                  model card, rendered from MODEL_CARD.md
      speculative_config.json    target it was built for, generation defaults (mode, tree_budget)
      custom_generate/           generate.py + requirements.txt: target.generate(custom_generate="<repo>", ...)
      *.py                       the model code files again: transformers looks for remote code at the repo root
                                 even when loading with ``subfolder=``
      dflash/                    config.json (auto_map), configuration_dflash.py, modeling_dflash.py, model.safetensors
      weaver/                    config.json (auto_map), configuration_weaver.py, modeling_weaver.py, model.safetensors
      .modeling_weaver_output    marker: a folder we wrote, which ``--overwrite`` may replace (output_dir.py)

``AutoModel.from_pretrained(repo, subfolder="dflash" | "weaver", trust_remote_code=True)`` loads each model. The
folders under ``hub_configs/`` have the same layout without weights (random init through ``from_config``); they are
generated from the package sources by :func:`sync_hub_configs` and tested to stay in sync.

The templates (``MODEL_CARD.md``, ``custom_generate/``) live at the top of a source checkout; exporting needs one.
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Callable

import torch

from .configuration_dflash import DFlashConfig
from .configuration_weaver import WeaverConfig
from .convert import CheckpointError
from .modeling_dflash import DFlashDraftModel
from .modeling_weaver import WeaverModel
from .output_dir import stamp_code_copies, with_banner, written_output
from .pairing import PairingError, _config, _text, check_pair

__all__ = [
    "HUB_SPECS",
    "PairingError",
    "check_pair",
    "export_pair",
    "render_card",
    "resolve_drafters",
    "sync_hub_configs",
]

SOURCE_ROOT = Path(__file__).resolve().parents[1]
HUB_CONFIGS = SOURCE_ROOT / "hub_configs"
SPECULATIVE_CONFIG = "speculative_config.json"
FORMAT = "modeling-weaver/1"


def target_summary(target_config) -> dict:
    """The target facts a pair depends on (written to ``speculative_config.json``)."""
    text = _text(_config(target_config))
    return {
        "model_type": text.model_type,
        "hidden_size": text.hidden_size,
        "num_hidden_layers": text.num_hidden_layers,
        "vocab_size": text.vocab_size,
        "embedding_size": getattr(text, "embedding_size", None) or text.hidden_size,
    }


# ----------------------------------------------------------------------------------------------------- model folders


def _write_code_and_config(config, folder: Path, model_class) -> None:
    """config.json with both auto_map entries plus the code files ``save_pretrained`` would copy — no weights."""
    from transformers.dynamic_module_utils import custom_object_save

    folder.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = model_class(config)
    config = model.config
    custom_object_save(model, folder, config=config)  # modeling file (+ relative imports), AutoModel auto_map entry
    config.save_pretrained(folder)  # config.json (+ AutoConfig entry, configuration file)
    _normalise_config_json(folder / "config.json")
    stamp_code_copies(folder)


def _normalise_config_json(path: Path) -> None:
    """Drop the writer's transformers version so generated folders do not churn with every upgrade."""
    raw = json.loads(path.read_text())
    raw.pop("transformers_version", None)
    path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def _shape_line(config) -> str:
    if isinstance(config, DFlashConfig):
        types = set(config.layer_types or ["full_attention"])
        window = (f", sliding window {config.sliding_window} on "
                  f"{sum(t == 'sliding_attention' for t in config.layer_types)} layers"
                  if "sliding_attention" in types else "")
        mask = (f"mask token {config.mask_token_id}" if config.mask_token_id is not None
                else "learned mask embedding (the vocabulary has no mask token)")
        return (f"{config.num_hidden_layers} non-causal Qwen3-style layers, hidden {config.hidden_size}, "
                f"{config.num_attention_heads} q-heads / {config.num_key_value_heads} kv-heads × {config.head_dim}, "
                f"FFN {config.intermediate_size}{window}; block {config.block_size}; target features from layers "
                f"{config.target_layer_ids}; {mask}")
    return (f"{config.num_layers} layer(s), d_rank {config.d_rank}, {config.num_heads} heads, SwiGLU {config.mlp_dim}, "
            f"K {config.K}, candidate pool {config.candidate_pool_size}")


def _target_shape_line(target_config) -> str:
    text = _text(_config(target_config))
    kinds = sorted(set(getattr(text, "layer_types", None) or ["full_attention"]))
    mixers = " + ".join({"linear_attention": "Gated DeltaNet", "full_attention": "attention",
                         "sliding_attention": "sliding attention"}.get(k, k) for k in kinds)
    return (f"`{type(text).__name__}`, hidden {text.hidden_size}, {text.num_hidden_layers} layers ({mixers}), "
            f"vocab {text.vocab_size}")


# ---------------------------------------------------------------------------------------------------------- templates


def _template(path: str) -> Path:
    file = SOURCE_ROOT / path
    if not file.exists():
        raise FileNotFoundError(f"{file} not found: exporting needs a source checkout of modeling-weaver (the "
                                f"templates MODEL_CARD.md and custom_generate/ live at its top level)")
    return file


#: The recipe's files, and where in a repo they go: ``custom_generate/`` (what transformers loads for
#: ``custom_generate="<repo>"``) and the same files once more one level down, so that ``custom_generate=
#: "<repo>/custom_generate"`` (the folder itself, an easy mistake) loads the same recipe instead of failing.
RECIPE_FILES = ("generate.py", "requirements.txt")
RECIPE_FOLDERS = ("custom_generate", "custom_generate/custom_generate")


def write_custom_generate(repo: Path) -> None:
    """Copy the ``custom_generate/`` recipe (generate.py + requirements.txt, both read past a ``#`` line) into a repo
    folder (see :data:`RECIPE_FOLDERS`), each file under the generated-file banner."""
    src = _template("custom_generate")
    for folder in RECIPE_FOLDERS:
        dst = Path(repo) / folder
        dst.mkdir(parents=True, exist_ok=True)
        for name in RECIPE_FILES:
            text = (src / name).read_text(encoding="utf-8")
            (dst / name).write_text(with_banner(text, f"custom_generate/{name}"), encoding="utf-8")


_FIELD = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def render_card(fields: dict, template: str | None = None) -> str:
    """Fill ``MODEL_CARD.md``; fields without a value become a bold ``[TO FILL: name]`` marker."""
    text = template if template is not None else _template("MODEL_CARD.md").read_text()
    text = re.sub(r"<!-- template-note.*?-->\n", "", text, flags=re.DOTALL)

    def value(match):
        got = fields.get(match.group(1))
        return str(got) if got not in (None, "") else f"**[TO FILL: {match.group(1)}]**"

    return _FIELD.sub(value, text)


def _defaults_line(defaults: dict) -> str:
    """The card's line for a repo's generation defaults; a missing one is the device's at generation time."""
    mode, budget = defaults.get("mode"), defaults.get("tree_budget")
    mode = f'`mode="{mode}"`' if mode else "the device's mode (weaver on CUDA, ddtree on CPU)"
    budget = f"`tree_budget={budget}`" if budget else "the device's budget (64 on CUDA, 5 on CPU)"
    return f"{mode}, {budget}"


def _card_fields(name, target_name, target_config, dflash_config, weaver_config, defaults, extra) -> dict:
    fields = {
        "repo_name": name,
        "repo_id": f"<org>/{name}",
        "target_model": target_name,
        "target_shape": _target_shape_line(target_config),
        "dflash_shape": _shape_line(dflash_config),
        "weaver_shape": _shape_line(weaver_config) if weaver_config is not None else "none (DFlash only)",
        "block_size": dflash_config.block_size,
        "generation_defaults": _defaults_line(defaults),
        "tree_budget": defaults.get("tree_budget") or 64,  # (the card's example runs on CUDA)
        "license": "apache-2.0",
        "extra_limitations": "",
    }
    fields.update(extra or {})
    return fields


# ------------------------------------------------------------------------------------------------------------- export


def _write_repo(out: Path, *, name: str, target_name: str, target_config, dflash, weaver, defaults: dict,
                card: dict | None, write_dflash: Callable[[Path], None], write_weaver: Callable[[Path], None] | None):
    dflash_config, weaver_config = _config(dflash), (_config(weaver) if weaver is not None else None)
    check_pair(target_config, dflash_config, weaver_config)
    out.mkdir(parents=True, exist_ok=True)
    write_dflash(out / "dflash")
    if write_weaver is not None:
        write_weaver(out / "weaver")
    # transformers resolves remote code at the repo root even with `subfolder=` (get_class_from_dynamic_module drops
    # it), so the code files sit at the root as well: from_pretrained(repo, subfolder="dflash") and
    # from_pretrained(repo/dflash) both work.
    for sub in ("dflash", "weaver"):
        for code in sorted((out / sub).glob("*.py")) if (out / sub).is_dir() else ():
            shutil.copyfile(code, out / code.name)
    write_custom_generate(out)
    spec = {
        "format": FORMAT,
        "target_model": target_name,
        "target_config": target_summary(target_config),
        "subfolders": {"dflash": "dflash", **({"weaver": "weaver"} if weaver is not None else {})},
        "generation_defaults": defaults,
    }
    (out / SPECULATIVE_CONFIG).write_text(json.dumps(spec, indent=2) + "\n")
    fields = _card_fields(name, target_name, target_config, dflash_config, weaver_config, defaults, card)
    (out / "README.md").write_text(render_card(fields))
    return out


def export_pair(out, drafter: DFlashDraftModel, weaver: WeaverModel | None = None, *, target_config,
                target_name: str, name: str | None = None, mode: str | None = None, tree_budget: int | None = None,
                card: dict | None = None, dtype=None, overwrite: bool = False, inputs=()) -> Path:
    """Assemble a complete Hub repo folder from trained models: weights, configs, code, ``custom_generate/``,
    ``speculative_config.json`` and the model card (fields not given in ``card`` are left as marked placeholders).

    Args:
        out: the repo folder to write (must not exist unless ``overwrite``).
        drafter, weaver: trained models (``weaver=None`` exports a DFlash-only repo).
        mode, tree_budget: the generation defaults written to ``speculative_config.json``; None: the device's at
            generation time (:func:`~modeling_weaver.tree.default_tree_mode`,
            :func:`~modeling_weaver.tree.default_tree_budget`: Weaver trees of 64 on CUDA, DDTree of 5 on a CPU).
        target_config: the target's config (checked with :func:`check_pair` before anything is written).
        target_name: Hub id of the target, e.g. ``"Qwen/Qwen3.6-27B"``.
        card: model-card fields (see ``MODEL_CARD.md``): training data / steps, ``results_table``,
            ``results_command``, licences...
        dtype: cast the saved weights (e.g. ``torch.bfloat16``); default keeps the models' dtype.
        overwrite: replace ``out`` if it holds an earlier output of ours (:mod:`modeling_weaver.output_dir`).
        inputs: paths the models were read from; ``out`` must not overlap them.
    """
    out = Path(out)
    if mode is not None and mode not in ("weaver", "ddtree", "chain"):
        raise ValueError(f'mode must be "weaver", "ddtree", "chain" or None (the device\'s), got {mode!r}')
    if mode == "weaver" and weaver is None:
        raise ValueError('mode="weaver" needs a Weaver; export one or choose mode="ddtree"/"chain"')
    if tree_budget is not None and (isinstance(tree_budget, bool) or not isinstance(tree_budget, int)
                                    or tree_budget < 1):
        raise ValueError(f"tree_budget must be a whole number >= 1 or None (the device's), got {tree_budget!r}")

    def saver(model):
        def save(folder: Path):
            (model.to(dtype) if dtype is not None else model).save_pretrained(folder)
            _normalise_config_json(folder / "config.json")
            stamp_code_copies(folder)
        return save

    with written_output(out, inputs, overwrite) as tmp:
        _write_repo(tmp, name=name or out.name, target_name=target_name, target_config=target_config,
                    dflash=drafter, weaver=weaver, defaults={"mode": mode, "tree_budget": tree_budget},
                    card=card, write_dflash=saver(drafter),
                    write_weaver=saver(weaver) if weaver is not None else None)
    return out


# ------------------------------------------------------------------------------------------------------- hub_configs


def qwen3_6_27b_config():
    """Text part of Qwen3.6-27B (docs/DESIGN.md §7): 64 layers = 16 × (3 GDN + 1 gated attention), hidden 5120."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25},
    )


def qwen3_5_35b_a3b_config():
    """Text part of Qwen3.5-35B-A3B (hybrid MoE): 40 layers = 10 × (3 GDN + 1 gated attention), hidden 2048, 256
    experts (8 routed + 1 gated shared, 512 wide each). Public-config values as recalled, not read from the Hub here:
    rope_theta and max positions are assumed equal to the 27B's."""
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25},
    )


def qwen3_next_80b_a3b_config():
    """Qwen3-Next-80B-A3B (hybrid MoE): 48 layers = 12 × (3 GDN + 1 gated attention), hidden 2048, 512 experts (10
    routed + 1 gated shared, 512 wide each), Qwen3 vocabulary. Public-config values as recalled, not read from the Hub
    here; the dense ``intermediate_size`` (5120, used by no layer) is assumed."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512,
        num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25},
    )


def kimi_linear_48b_a3b_config():
    """Kimi Linear 48B-A3B (``KimiLinearConfig``): 27 layers, KDA and MLA 3:1 (the MLA layers 4, 8, …, 24 and the
    last), hidden 2304, 32 heads (KDA 128-dim; MLA latent rank 512, q heads 128 + 64 RoPE dims, values 128), 256
    experts (8 routed + 1 shared, 1024 wide) after one dense layer (FFN 9216), vocab 163840. Public-config values as
    recalled (transformers' defaults for this class are the same sizes), not read from the Hub here: the layer pattern
    and the 1M positions are assumed."""
    from transformers import KimiLinearConfig

    mla = [4, 8, 12, 16, 20, 24, 27]  # 1-based, as the checkpoint's linear_attn_config lists them
    return KimiLinearConfig(
        vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024, num_hidden_layers=27,
        num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, num_local_experts=256, num_experts_per_tok=8, n_shared_experts=1,
        n_group=1, topk_group=1, routed_scaling_factor=2.446, max_position_embeddings=1048576, rms_norm_eps=1e-5,
        first_k_dense_replace=1, linear_attn_config=dict(
            full_attn_layers=mla, kda_layers=[i for i in range(1, 28) if i not in mla], head_dim=128, num_heads=32,
            short_conv_kernel_size=4),
    )


def smollm2_135m_config():
    """HuggingFaceTB/SmolLM2-135M-Instruct (Llama; docs/DESIGN.md §7 plus its published config.json)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )


# z-lab's 27B drafters (Qwen3.5-27B-DFlash, Qwen3.6-27B-DFlash; both 3.22 GiB bf16): 5 layers, 32 q-heads / 8 kv-heads
# × 128, FFN 17408, block 16, mask token 248070, features from layers [1, 16, 31, 46, 61]. The 3.6 drafter's layers are
# [sliding × 4, full] with a 2048-token window (causal inside the block, z-lab's rule for sliding layers).
_ZLAB_27B_HEADS = dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128)
_QWEN36_SLIDING = dict(layer_types=["sliding_attention"] * 4 + ["full_attention"], use_sliding_window=True,
                       sliding_window=2048, max_window_layers=0)


@dataclass
class HubSpec:
    """One ``hub_configs/<folder>``: a target and the configs of the pair built for it."""

    folder: str
    target_name: str
    target: Callable[[], object]
    dflash: Callable[[object], DFlashConfig]
    weaver: Callable[[object, DFlashConfig], WeaverConfig]
    card: dict = field(default_factory=dict)
    defaults: dict = field(default_factory=lambda: {"mode": "weaver", "tree_budget": 64})


_CONFIG_ONLY = ("**configuration only — no trained weights in this folder.** `AutoModel.from_config` gives a "
                "randomly initialised model of the right shape; train it (or convert a published checkpoint: "
                "`weaver convert`) and publish with `weaver export`.")
_QWEN_CARD = {
    "status": _CONFIG_ONLY,
    "target_license": "Apache-2.0",
    "extra_limitations": "- A published z-lab DFlash checkpoint for this target loads into `dflash/` unchanged "
                         "(`weaver convert <z-lab folder> <out>`); the paper's Weaver release converts the same way.",
}

HUB_SPECS: dict[str, HubSpec] = {
    spec.folder: spec
    for spec in (
        HubSpec(
            folder="qwen3.6-27b", target_name="Qwen/Qwen3.6-27B", target=qwen3_6_27b_config,
            dflash=lambda t: DFlashConfig.from_target_config(
                t, num_hidden_layers=5, block_size=16, mask_token_id=248070, target_layer_ids=[1, 16, 31, 46, 61],
                **_ZLAB_27B_HEADS, **_QWEN36_SLIDING),
            weaver=lambda t, d: WeaverConfig.from_target_config(t, d, d_rank=2048, num_layers=1, num_heads=16,
                                                                mlp_dim=1368, candidate_pool_size=512),
            card=_QWEN_CARD,
        ),
        HubSpec(
            folder="qwen3.5-27b", target_name="Qwen/Qwen3.5-27B", target=qwen3_6_27b_config,  # same text shape
            dflash=lambda t: DFlashConfig.from_target_config(
                t, num_hidden_layers=5, block_size=16, mask_token_id=248070, target_layer_ids=[1, 16, 31, 46, 61],
                **_ZLAB_27B_HEADS),
            weaver=lambda t, d: WeaverConfig.from_target_config(t, d, d_rank=2048, num_layers=1, num_heads=16,
                                                                mlp_dim=1368, candidate_pool_size=512),
            card=_QWEN_CARD,
        ),
        HubSpec(
            # no published DFlash drafter is known for it: the package's default drafter shape; the Qwen3.5 vocabulary
            # has the 27B drafters' mask token (assumed to be the same tokenizer)
            folder="qwen3.5-35b-a3b", target_name="Qwen/Qwen3.5-35B-A3B", target=qwen3_5_35b_a3b_config,
            dflash=lambda t: DFlashConfig.from_target_config(t, num_hidden_layers=5, block_size=16,
                                                             mask_token_id=248070),
            weaver=lambda t, d: WeaverConfig.from_target_config(t, d),
            card={"status": _CONFIG_ONLY, "target_license": "Apache-2.0"},
        ),
        HubSpec(
            # no published DFlash drafter is known for it: the package's default drafter shape, a learned mask
            # embedding (no mask token of the Qwen3 vocabulary is assumed)
            folder="qwen3-next-80b-a3b", target_name="Qwen/Qwen3-Next-80B-A3B-Instruct",
            target=qwen3_next_80b_a3b_config,
            dflash=lambda t: DFlashConfig.from_target_config(t, num_hidden_layers=5, block_size=16,
                                                             mask_token_id=None),
            weaver=lambda t, d: WeaverConfig.from_target_config(t, d),
            card={"status": _CONFIG_ONLY, "target_license": "Apache-2.0"},
        ),
        HubSpec(
            # no published DFlash drafter is known for it: the package's default drafter shape (32 heads of hidden /
            # heads = 72: its head_dim is MLA's RoPE part), a learned mask embedding (no mask token of its vocabulary
            # is assumed)
            folder="kimi-linear-48b-a3b", target_name="moonshotai/Kimi-Linear-48B-A3B-Instruct",
            target=kimi_linear_48b_a3b_config,
            dflash=lambda t: DFlashConfig.from_target_config(t, num_hidden_layers=5, block_size=16,
                                                             mask_token_id=None),
            weaver=lambda t, d: WeaverConfig.from_target_config(t, d),
            card={"status": _CONFIG_ONLY, "target_license": "MIT"},
        ),
        HubSpec(
            folder="smollm2-135m-instruct", target_name="HuggingFaceTB/SmolLM2-135M-Instruct",
            target=smollm2_135m_config,
            dflash=lambda t: DFlashConfig.from_target_config(t, num_hidden_layers=5, block_size=16,
                                                             mask_token_id=None),
            weaver=lambda t, d: WeaverConfig.from_target_config(t, d),
            card={"status": _CONFIG_ONLY, "target_license": "Apache-2.0"},
        ),
    )
}


def render_hub_config(spec: HubSpec, out) -> Path:
    """Write one ``hub_configs`` folder (no weights) for ``spec`` into ``out``."""
    target = spec.target()
    dflash = spec.dflash(target)
    weaver = spec.weaver(target, dflash)
    with written_output(out) as tmp:
        _write_repo(
            tmp, name=spec.folder, target_name=spec.target_name, target_config=target, dflash=dflash,
            weaver=weaver, defaults=dict(spec.defaults), card=spec.card,
            write_dflash=lambda folder: _write_code_and_config(dflash, folder, DFlashDraftModel),
            write_weaver=lambda folder: _write_code_and_config(weaver, folder, WeaverModel),
        )
    return Path(out)


def _tree(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def sync_hub_configs(root=None, check: bool = False, names=None) -> list[str]:
    """Regenerate ``hub_configs/<folder>`` from :data:`HUB_SPECS` and the package sources.

    Returns the paths (relative to ``root``) that differ from what the package would generate; with ``check=True``
    nothing is written (the test uses this to keep the folders in sync with the code).
    """
    root = Path(root) if root is not None else HUB_CONFIGS
    differences = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names or HUB_SPECS:
            fresh = render_hub_config(HUB_SPECS[name], Path(tmp) / name)
            current = root / name
            fresh_files, current_files = _tree(fresh), (_tree(current) if current.exists() else set())
            changed = sorted((fresh_files ^ current_files) | {
                f for f in fresh_files & current_files
                if not filecmp.cmp(fresh / f, current / f, shallow=False)})
            differences += [f"{name}/{f}" for f in changed]
            if changed and not check:
                with written_output(current, overwrite=True) as tmp_current:
                    shutil.copytree(fresh, tmp_current, dirs_exist_ok=True)
    return differences


# ------------------------------------------------------------------------------------------------- custom_generate


_LOADED: dict = {}


#: ``generation_defaults`` a speculative_config.json may give, and the type of each.
GENERATION_DEFAULTS = {"mode": str, "tree_budget": int, "verification": str, "target_step": str}


def _checked_speculative_config(file: Path) -> dict:
    """``speculative_config.json`` read and checked before use; errors name the file and the field."""
    try:
        spec = json.loads(file.read_text())
    except ValueError as err:
        raise CheckpointError(f"{file}: not valid JSON ({err})") from err
    if not isinstance(spec, dict):
        raise CheckpointError(f"{file}: expected a JSON object, found {type(spec).__name__}")
    for name in ("subfolders", "generation_defaults"):
        if not isinstance(spec.get(name, {}), dict):
            raise CheckpointError(f"{file}: field '{name}' must be an object, found {type(spec[name]).__name__}")
    for key, value in spec.get("generation_defaults", {}).items():
        kind = GENERATION_DEFAULTS.get(key)
        if kind is None:
            raise CheckpointError(f"{file}: field 'generation_defaults.{key}' is not one of "
                                  f"{', '.join(GENERATION_DEFAULTS)}")
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise CheckpointError(f"{file}: field 'generation_defaults.{key}' must be a {kind.__name__}, got "
                                  f"{value!r}")
    return spec


def _read_speculative_config(path) -> dict:
    local = Path(path)
    file = local / SPECULATIVE_CONFIG
    if local.exists():
        return _checked_speculative_config(file) if file.is_file() else {}
    try:  # a Hub id: the file is optional
        from huggingface_hub import hf_hub_download

        file = Path(hf_hub_download(str(path), SPECULATIVE_CONFIG))
    except Exception:  # noqa: BLE001 - offline, missing file, ...
        return {}
    return _checked_speculative_config(file)


def _subfolder(path, spec: dict, role: str):
    """A pair repo's ``dflash/`` / ``weaver/`` subfolder, or ``path`` itself when it is a model folder. The subfolder
    must lie inside the repo (no absolute path, no ``..``, no symlink out of it): a repo may not point us elsewhere."""
    sub = (spec.get("subfolders") or {}).get(role)
    if sub is None:
        return path
    parts = PurePosixPath(sub).parts if isinstance(sub, str) else ()
    escape = (not parts or ".." in parts or "\\" in sub or PurePosixPath(sub).is_absolute()
              or Path(sub).is_absolute())
    if not escape and Path(path).exists():
        root = Path(path).resolve()
        inside = (root / sub).resolve()
        escape = inside != root and root not in inside.parents
    if escape:
        raise CheckpointError(f"{Path(str(path)) / SPECULATIVE_CONFIG}: subfolders.{role} = {sub!r} does not name a "
                              "folder inside the repo")
    return os.path.join(str(path), sub) if Path(path).exists() else (str(path), sub)


def resolve_drafters(target, drafter, weaver):
    """For ``custom_generate``: models pass through; a path / Hub id (a pair repo or a model folder) is loaded onto
    the target's device and dtype (once per process). Returns ``(drafter, weaver, generation_defaults)``."""
    from .convert import load_dflash, load_weaver

    defaults = {}
    device, dtype = target.device, target.dtype

    def load(ref, role, loader):
        nonlocal defaults
        if not isinstance(ref, (str, os.PathLike)):
            return ref
        spec = _read_speculative_config(ref)
        defaults = {**spec.get("generation_defaults", {}), **defaults}
        where = _subfolder(ref, spec, role)
        key = (role, str(where), str(device), dtype)
        if key not in _LOADED:
            if isinstance(where, tuple):  # Hub repo + subfolder
                from huggingface_hub import snapshot_download

                where = os.path.join(snapshot_download(where[0], allow_patterns=[f"{where[1]}/*"]), where[1])
            _LOADED[key] = loader(where, dtype=dtype, device=device)
        return _LOADED[key]

    drafter = load(drafter, "dflash", load_dflash)
    weaver = load(weaver, "weaver", load_weaver)
    if weaver is None and drafter is not None and defaults.get("mode") == "weaver":
        defaults["mode"] = "ddtree"
    return drafter, weaver, {k: v for k, v in defaults.items() if v is not None}

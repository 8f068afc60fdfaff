"""Checkpoints that already exist → our classes.

* **z-lab DFlash drafters** (``config.json`` with ``model_type "qwen3"``, ``dflash_config``, ``auto_map
  {"AutoModel": "dflash.DFlashDraftModel"}``; safetensors keys ``fc``, ``hidden_norm``, ``layers.*``, ``norm``) load
  *unchanged* into :class:`~modeling_weaver.DFlashDraftModel`: :func:`load_dflash` validates every tensor name and
  shape against the config first (clear errors naming the key), :func:`convert_dflash` re-saves one in our Hub layout
  (``model_type "dflash"``, our ``auto_map`` and code files).
* **The paper's Weaver release** (a ``.pth`` dict ``{"config", "state_dict"}``, docs/DESIGN.md §3, "Variant B"):
  :func:`read_released_weaver` maps the config field by field and checks every key and shape;
  :func:`convert_weaver` writes a :class:`~modeling_weaver.WeaverModel` Hub folder (config, code, safetensors). The
  older research variant (separate ``q_proj/k_proj/v_proj``, GELU ``fc1/fc2`` MLP, learned ``pos_emb``) computes
  something else and is refused with an error that names it.
* **transformers' own chain-DFlash path** (``generate(assistant_model=..., speculation_type="dflash")``, transformers
  ≥ 5.15): :func:`to_transformers_assistant` wraps a drafter in the forward contract that path calls
  (``noise_embeds, context_hidden_states, position_ids, attention_mask, cache``). Nothing in our own loop changes.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from torch import nn

from .configuration_dflash import DFlashConfig
from .configuration_weaver import WeaverConfig
from .files import load_dict_file
from .modeling_dflash import DFlashDraftModel
from .modeling_weaver import WeaverModel
from .output_dir import check_output, stamp_code_copies, written_output

__all__ = [
    "CheckpointError",
    "DFLASH_REQUIRED_FIELDS",
    "DFlashTransformersAssistant",
    "RELEASED_WEAVER_CONFIG_FIELDS",
    "WEAVER_REQUIRED_FIELDS",
    "checked_config",
    "convert_dflash",
    "convert_weaver",
    "is_zlab_dflash",
    "load_dflash",
    "load_released_weaver",
    "load_weaver",
    "read_released_weaver",
    "to_transformers_assistant",
]


class CheckpointError(ValueError):
    """A checkpoint does not have the layout it claims (missing / unexpected / mis-shaped tensor, bad config)."""


def _dtype(value) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    names = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
             "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}
    if value not in names:
        raise ValueError(f"unknown dtype {value!r}; use one of {sorted(names)}")
    return names[value]


def _expected_shapes(model_class, config) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of ``model_class(config)``, built on the meta device (no memory, any size)."""
    with torch.device("meta"):
        model = model_class(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _check_tensors(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], what: str,
                   hints: dict[str, str] | None = None) -> None:
    """Raise a :class:`CheckpointError` naming the first missing, unexpected or mis-shaped tensor (and the count)."""
    hints = hints or {}
    problems = []
    for key in sorted(set(expected) - set(found), key=_natural):
        problems.append(f"missing tensor '{key}' (expected shape {list(expected[key])})")
    for key in sorted(set(found) - set(expected), key=_natural):
        hint = next((text for pattern, text in hints.items() if re.search(pattern, key)), "")
        problems.append(f"unexpected tensor '{key}' {list(found[key])}" + (f" ({hint})" if hint else ""))
    for key in sorted(set(found) & set(expected), key=_natural):
        if tuple(found[key]) != tuple(expected[key]):
            problems.append(f"tensor '{key}' has shape {list(found[key])}, the config implies {list(expected[key])}")
    if problems:
        more = f" (+{len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise CheckpointError(f"{what}: {problems[0]}{more}")


def _save(model, dst, overwrite: bool, inputs=()) -> Path:
    """``save_pretrained`` into a fresh folder that replaces ``dst`` only once complete (no stale or partial files);
    see :mod:`modeling_weaver.output_dir` for what may be replaced."""
    with written_output(dst, inputs, overwrite) as tmp:
        model.save_pretrained(tmp)
        stamp_code_copies(tmp)
    return Path(dst)


def _natural(key: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


# -------------------------------------------------------------------------------------------------------------- DFlash


def is_zlab_dflash(path) -> bool:
    """True when ``path/config.json`` is a z-lab DFlash config (not yet re-saved by this package)."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return False
    raw = json.loads(config_file.read_text())
    auto_model = (raw.get("auto_map") or {}).get("AutoModel", "")
    return raw.get("model_type") == "qwen3" and ("dflash_config" in raw or auto_model.startswith("dflash."))


def _safetensors_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape of every ``*.safetensors`` file in ``folder`` (headers only, nothing is loaded)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors file (a DFlash checkpoint folder holds config.json and "
                              "model.safetensors)")
    shapes = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    shapes[key] = tuple(handle.get_slice(key).get_shape())
        except Exception as err:  # noqa: BLE001 - truncated files, bad headers, ... (SafetensorError is no ValueError)
            raise CheckpointError(f"{file}: not a readable safetensors file ({' '.join(str(err).split())[:300]})"
                                  ) from err
    return shapes


#: ``config.json`` fields a checkpoint must state: a missing one would load as a silent default (rope θ 10000, a
#: 151936-token vocabulary...) or fail later with an unrelated error.
DFLASH_REQUIRED_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "block_size")
WEAVER_REQUIRED_FIELDS = ("d_model", "d_embed", "d_rank", "num_layers", "num_heads", "mlp_dim", "K",
                          "candidate_pool_size", "rope_base", "norm_eps")


def _config_file(path) -> Path:
    """``config.json`` of a local model folder or a Hub id (downloaded to the cache)."""
    local = Path(path)
    if local.exists():
        if not (local / "config.json").is_file():
            raise CheckpointError(f"{local}: no config.json (expected a model folder)")
        return local / "config.json"
    from transformers.utils import cached_file

    return Path(cached_file(str(path), "config.json"))


def checked_config(path, kind: str):
    """The :class:`DFlashConfig` (``kind="dflash"``) or :class:`WeaverConfig` (``"weaver"``) of a checkpoint folder
    or Hub id, after checking that its ``config.json`` states every required field (else :class:`CheckpointError`
    naming the file and the field)."""
    file = _config_file(path)
    try:
        raw = json.loads(file.read_text())
    except ValueError as err:
        raise CheckpointError(f"{file}: not valid JSON ({err})") from err
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    required = {"dflash": DFLASH_REQUIRED_FIELDS, "weaver": WEAVER_REQUIRED_FIELDS}[kind]
    missing = [name for name in required if raw.get(name) is None]
    if kind == "dflash" and (raw.get("rope_parameters") or {}).get("rope_theta", raw.get("rope_theta")) is None:
        missing.append("rope_parameters.rope_theta")  # z-lab files spell it top-level `rope_theta`
    if missing:
        more = f" (also: {', '.join(missing[1:])})" if len(missing) > 1 else ""
        raise CheckpointError(f"{file}: required field '{missing[0]}' is missing{more}")
    config_class = DFlashConfig if kind == "dflash" else WeaverConfig
    try:
        config = config_class.from_pretrained(file.parent)
    except (TypeError, ValueError, KeyError, IndexError) as err:
        raise CheckpointError(f"{file}: config does not describe a valid {kind} model: {err}") from err
    if kind == "dflash" and not config.target_layer_ids:
        raise CheckpointError(f"{file}: dflash_config.target_layer_ids is missing (and no num_target_layers to "
                              "derive it)")
    return config


def load_dflash(path, dtype=None, device=None, validate: bool = True) -> DFlashDraftModel:
    """Load a DFlash drafter from a z-lab checkpoint or one of ours (local folder or Hub id), unchanged.

    For a local folder every tensor name and shape is first checked against the config, so a checkpoint that does not
    fit fails with the offending key named instead of loading partly random weights. No remote code is executed: our
    own class reads z-lab's ``config.json`` and keys as they are.
    """
    dtype = _dtype(dtype)
    local = Path(path)
    config = checked_config(path, "dflash")
    if local.exists():
        if validate:
            _check_tensors(
                _safetensors_shapes(local), _expected_shapes(DFlashDraftModel, config), f"DFlash checkpoint {local}",
                hints={r"embed_tokens|lm_head": "DFlash drafters use the target's embedding and lm_head",
                       r"^model\.": "keys must not carry a 'model.' prefix"},
            )
    kwargs = {"dtype": dtype} if dtype is not None else {}
    model = DFlashDraftModel.from_pretrained(path, **kwargs)
    if device is not None:
        model = model.to(device)
    return model.eval()


def convert_dflash(src, dst, dtype=None, overwrite: bool = False) -> Path:
    """z-lab (or our) DFlash checkpoint ``src`` → our Hub layout in ``dst`` (config with our ``auto_map``, code files,
    ``model.safetensors``). Tensors are copied unchanged unless ``dtype`` is given."""
    check_output(dst, [src], overwrite)  # refuse before reading the weights
    return _save(load_dflash(src, dtype=dtype), dst, overwrite, [src])


# -------------------------------------------------------------------------------------------------------------- Weaver

#: Released ``.pth`` config field → :class:`WeaverConfig` field (None: checked, not stored).
RELEASED_WEAVER_CONFIG_FIELDS: dict[str, str | None] = {
    "d_model": "d_model",
    "d_embed": "d_embed",
    "d_rank": "d_rank",
    "num_layers": "num_layers",
    "num_heads": "num_heads",
    "mlp_dim": "mlp_dim",
    "K": "K",
    "candidate_pool_size": "candidate_pool_size",
    "rope_base": "rope_base",
    "norm_eps": "norm_eps",
    "encoder_mode": None,  # 3 = global prompt (the only encoder of the release)
    "score_head": None,  # 4 = simple score head: dflash logit + E_lm[c] · query
    "activation": None,  # "swiglu"
}
_REQUIRED_WEAVER_FIELDS = ("d_model", "d_embed", "d_rank", "num_layers", "num_heads", "mlp_dim", "K",
                           "candidate_pool_size")
# Bookkeeping fields a release may carry that do not change the computation.
_IGNORED_WEAVER_FIELDS = ("dtype", "torch_dtype", "version", "model_type", "name", "target_model", "target",
                          "base_model")
_SUPPORTED = "modeling-weaver implements the released layout ('Variant B': fused qkv_proj, SwiGLU gate_up_proj, RoPE)"
_OLD_VARIANT = ("the older Weaver variant (separate q_proj/k_proj/v_proj, GELU fc1/fc2 MLP, learned pos_emb) is not "
                "supported")
_OLD_VARIANT_KEYS = re.compile(r"(^|\.)(q_proj|k_proj|v_proj|fc1|fc2)\.(weight|bias)$|(^|\.)pos_emb$")


def read_released_weaver(path_or_payload) -> tuple[WeaverConfig, dict[str, torch.Tensor]]:
    """Read and validate the paper's ``.pth`` payload ``{"config": {...}, "state_dict": {...}}``.

    Returns our :class:`WeaverConfig` (fields mapped one to one, see :data:`RELEASED_WEAVER_CONFIG_FIELDS`) and the
    state dict (``module.`` / ``_orig_mod.`` prefixes of DDP / compiled training runs stripped). Raises
    :class:`CheckpointError` naming the config field or tensor key that does not fit, and naming the older variant
    when its keys or settings are present.
    """
    if isinstance(path_or_payload, (str, os.PathLike)):
        where = str(path_or_payload)
        payload = load_dict_file(path_or_payload, "a plain torch checkpoint", ("config", "state_dict"),
                                 error=CheckpointError)
    else:
        where, payload = "Weaver checkpoint", path_or_payload
    if not isinstance(payload, dict) or "config" not in payload or "state_dict" not in payload:
        found = sorted(payload)[:8] if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(f"{where}: expected a dict with keys 'config' and 'state_dict', found {found}")
    if not isinstance(payload["config"], dict):
        raise CheckpointError(f"{where}: 'config' must be a dict of Weaver config fields, found "
                              f"{type(payload['config']).__name__}")
    raw, state = dict(payload["config"]), payload["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{where}: 'state_dict' must map names to tensors")
    state = {re.sub(r"^(module\.|_orig_mod\.)+", "", key): value for key, value in state.items()}

    old = sorted((k for k in state if _OLD_VARIANT_KEYS.search(k)), key=_natural)
    if old:
        raise CheckpointError(f"{where}: {_OLD_VARIANT}: found '{old[0]}'. {_SUPPORTED}.")
    activation = str(raw.get("activation", "swiglu")).lower()
    if activation != "swiglu":
        raise CheckpointError(f"{where}: config 'activation' = {raw['activation']!r}: {_OLD_VARIANT}. {_SUPPORTED}.")
    for field, supported, meaning in (("encoder_mode", 3, "global-prompt encoder"),
                                      ("score_head", 4, "simple score head")):
        if field in raw and int(raw[field]) != supported:
            raise CheckpointError(f"{where}: config '{field}' = {raw[field]!r}: only the {meaning} Weaver variant "
                                  f"({field}={supported}) is supported. {_SUPPORTED}.")

    unknown = sorted(set(raw) - set(RELEASED_WEAVER_CONFIG_FIELDS) - set(_IGNORED_WEAVER_FIELDS))
    if unknown:
        raise CheckpointError(f"{where}: unrecognised config field '{unknown[0]}' (known: "
                              f"{', '.join(RELEASED_WEAVER_CONFIG_FIELDS)}); refusing to guess what it changes")
    missing = [f for f in _REQUIRED_WEAVER_FIELDS if f not in raw]
    if missing:
        raise CheckpointError(f"{where}: config field '{missing[0]}' is missing")
    fields = {ours: raw[theirs] for theirs, ours in RELEASED_WEAVER_CONFIG_FIELDS.items()
              if ours is not None and theirs in raw}
    try:
        config = WeaverConfig(**fields)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: config does not describe a valid Weaver: {err}") from err
    _check_tensors({k: tuple(v.shape) for k, v in state.items()}, _expected_shapes(WeaverModel, config),
                   f"Weaver checkpoint {where}")
    bad = [k for k, v in state.items() if not v.is_floating_point()]
    if bad:
        raise CheckpointError(f"{where}: tensor '{bad[0]}' has dtype {state[bad[0]].dtype}, expected floating point")
    return config, state


def load_released_weaver(path_or_payload, dtype=None) -> WeaverModel:
    """The released ``.pth`` as a :class:`WeaverModel` (validated by :func:`read_released_weaver`).

    ``dtype=None`` keeps the checkpoint's dtype (bf16 stays bf16)."""
    config, state = read_released_weaver(path_or_payload)
    model = WeaverModel(config)
    model.load_state_dict(state, strict=True)
    dtype = _dtype(dtype) or next(iter(state.values())).dtype
    return model.to(dtype).eval()


def convert_weaver(src, dst, dtype=None, overwrite: bool = False) -> Path:
    """Released Weaver ``.pth`` ``src`` → our Hub folder ``dst`` (config.json with ``auto_map``, code, safetensors)."""
    check_output(dst, [src], overwrite)
    return _save(load_released_weaver(src, dtype=dtype), dst, overwrite, [src])


def load_weaver(path, dtype=None, device=None) -> WeaverModel:
    """A Weaver from our Hub folder / Hub id, or from the paper's ``.pth`` release."""
    dtype = _dtype(dtype)
    if str(path).endswith((".pth", ".pt")):
        model = load_released_weaver(path, dtype=dtype)
    else:
        checked_config(path, "weaver")
        model = WeaverModel.from_pretrained(path, **({"dtype": dtype} if dtype is not None else {}))
    if device is not None:
        model = model.to(device)
    return model.eval()


# ------------------------------------------------------------------------------------ transformers' chain-DFlash path


class DFlashTransformersAssistant(nn.Module):
    """A :class:`DFlashDraftModel` behind the forward contract of transformers' own chain-DFlash candidate generator.

    ``target.generate(input_ids, assistant_model=to_transformers_assistant(drafter), speculation_type="dflash")``
    calls ``forward(noise_embeds=, context_hidden_states=, position_ids=, attention_mask=, cache=)`` and reads
    ``.last_hidden_state``; it also reads ``config.{target_layer_ids, block_size, mask_token_id}`` and ``device``.
    The drafter's parameters are shared, not copied. That path is chain-only, greedy/sampling over a single draft, and
    transformers refuses it on stateful (hybrid GDN) targets; use :func:`modeling_weaver.speculative_generate` for
    trees and Qwen3.5/3.6.
    """

    def __init__(self, drafter: DFlashDraftModel):
        super().__init__()
        if drafter.config.mask_token_id is None:
            raise ValueError(
                "this drafter has no mask_token_id (it learned its own mask_embedding because the target vocabulary "
                "has no mask token); transformers' chain-DFlash path fills the block with a mask *token id*, so it "
                "cannot run it. Use modeling_weaver.speculative_generate(..., mode='chain') instead."
            )
        self.drafter = drafter
        self.config = drafter.config
        self.main_input_name = "noise_embeds"

    @property
    def device(self) -> torch.device:
        return self.drafter.device

    @property
    def dtype(self) -> torch.dtype:
        return self.drafter.dtype

    def forward(self, noise_embeds: torch.Tensor, context_hidden_states: torch.Tensor,
                position_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                cache=None, use_cache: bool | None = None, **kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPast

        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            total = context_hidden_states.shape[1] + noise_embeds.shape[1]
            position_ids = torch.arange(past, past + total, device=noise_embeds.device)[None]
        if attention_mask is not None and attention_mask.dim() == 2:
            # A [B, past + C + S] padding mask; batch 1 without padding means "see everything".
            attention_mask = None if bool(attention_mask.all()) else attention_mask.bool()[:, None, None, :]
        hidden = self.drafter(
            noise_embedding=noise_embeds.to(self.drafter.dtype), target_hidden=context_hidden_states,
            position_ids=position_ids, past_key_values=cache, use_cache=True, attention_mask=attention_mask,
        )
        return BaseModelOutputWithPast(last_hidden_state=hidden)


def to_transformers_assistant(drafter: DFlashDraftModel) -> DFlashTransformersAssistant:
    """Wrap a drafter (ours or a z-lab checkpoint loaded with :func:`load_dflash`) for
    ``target.generate(assistant_model=..., speculation_type="dflash")``."""
    return DFlashTransformersAssistant(drafter)

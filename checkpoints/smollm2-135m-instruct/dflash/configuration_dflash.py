# Generated from modeling_weaver/configuration_dflash.py — do not edit; edit the source and run `weaver export`.
"""DFlash block drafter configuration (z-lab layout, docs/DESIGN.md §2).

A DFlash drafter is a small stack of Qwen3-style decoder layers that drafts a whole block ``[b, MASK × (B-1)]`` in one
non-causal forward, conditioned on hidden states of the target model. Published z-lab checkpoints are plain Qwen3
configs (``model_type "qwen3"``) with a few extra fields; :class:`DFlashConfig` reads them unchanged.
"""

from __future__ import annotations

from transformers import Qwen3Config

# Keys of a target's `rope_parameters` that describe the target's own attention layout (partial / multimodal RoPE)
# rather than the frequency schedule; the drafter always rotates its full head dim with 1-D positions.
_TARGET_ONLY_ROPE_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


def dflash_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """Default target layers whose outputs feed the drafter, z-lab's rule.

    ``num_features`` ids evenly spaced from layer 1 to layer ``num_target_layers - 3`` inclusive, rounded with
    Python's ``round``; a single feature takes the middle layer ``num_target_layers // 2``.

    >>> dflash_target_layer_ids(36, 5)
    [1, 9, 17, 25, 33]
    >>> dflash_target_layer_ids(64, 5)
    [1, 16, 31, 46, 61]
    """
    if num_target_layers < 1:
        raise ValueError(f"num_target_layers must be positive, got {num_target_layers}")
    if num_features < 1:
        raise ValueError(f"the drafter needs at least one target feature layer, got {num_features}")
    if num_features == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    available = end - start + 1
    if num_features > available:
        raise ValueError(
            f"cannot spread {num_features} distinct feature layers over layers {start}..{end} of a "
            f"{num_target_layers}-layer target ({max(available, 0)} available); pass target_layer_ids explicitly "
            "or use fewer drafter layers"
        )
    span = end - start
    return [int(round(start + i * span / (num_features - 1))) for i in range(num_features)]


def _text_config(config):
    """The decoder config of a target: `text_config` of multimodal wrappers (Qwen3_5Config), else the config."""
    text = getattr(config, "text_config", None)
    return text if text is not None else config


#: ``config.json`` fields that fix the drafter's tensor shapes: a file must state them (checked on load).
SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")


class DFlashConfig(Qwen3Config):
    r"""Configuration of a :class:`~modeling_weaver.modeling_dflash.DFlashDraftModel`.

    All Qwen3 fields apply to the drafter's own layers (``hidden_size`` must equal the target's). Extra fields:

    Args:
        block_size (`int`, defaults to 16):
            Block length B: the bonus token plus ``B - 1`` MASK positions drafted in one forward.
        dflash_config (`dict`):
            ``{"mask_token_id": int | None, "target_layer_ids": list[int]}``. ``target_layer_ids`` are indices of
            target decoder layers whose *outputs* (``hidden_states[id + 1]`` of HF ``output_hidden_states``) are
            concatenated into the drafter's context features. ``mask_token_id = None`` means the target vocabulary has
            no usable mask token: the drafter then owns a learned ``mask_embedding`` vector used at MASK positions.
        num_target_layers (`int`, *optional*):
            Number of decoder layers of the target the drafter was built for.

    Published z-lab ``config.json`` files (``model_type "qwen3"``, ``architectures ["DFlashDraftModel"]``) load
    unchanged; older variants with top-level ``mask_token_id`` / ``target_layer_ids`` are folded into
    ``dflash_config``.
    """

    model_type = "dflash"

    block_size: int = 16
    num_target_layers: int | None = None
    dflash_config: dict | None = None

    def __post_init__(self, **kwargs):
        # z-lab files say `model_type "qwen3"`; keep ours class-level so the config never claims to be a Qwen3 LM.
        kwargs.pop("model_type", None)
        self.dflash_config = dict(self.dflash_config or {})
        self.dflash_config.setdefault("mask_token_id", None)
        super().__post_init__(**kwargs)  # may route legacy top-level mask_token_id / target_layer_ids to the setters
        if self.dflash_config.get("target_layer_ids") is None and self.num_target_layers is not None:
            self.dflash_config["target_layer_ids"] = dflash_target_layer_ids(
                self.num_target_layers, self.num_hidden_layers
            )
        if self.architectures is None:
            self.architectures = ["DFlashDraftModel"]
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2 (bonus token + one MASK), got {self.block_size}")

    @classmethod
    def get_config_dict(cls, *args, **kwargs):
        config_dict, kwargs = super().get_config_dict(*args, **kwargs)
        # a field missing from config.json would load as the Qwen3 default (32 layers, a 151936-token vocabulary...)
        # and fail later with an unrelated error: name the file and the field instead
        missing = [name for name in SHAPE_FIELDS if config_dict.get(name) is None]
        wrong = [name for name in SHAPE_FIELDS if name not in missing and (
            not isinstance(config_dict[name], int) or isinstance(config_dict[name], bool) or config_dict[name] < 1)]
        if missing or wrong:
            where = f"{args[0]}/config.json" if args else "config.json"
            name = (missing or wrong)[0]
            raise ValueError(f"{where}: required field '{name}' is missing" if missing else
                             f"{where}: field '{name}' must be a positive integer, got {config_dict[name]!r}")
        # z-lab files declare `model_type "qwen3"`: recognise them as drafters instead of warning about a type mismatch.
        if "dflash_config" in config_dict or "DFlashDraftModel" in (config_dict.get("architectures") or []):
            config_dict = {**config_dict, "model_type": cls.model_type}
        return config_dict, kwargs

    @property
    def mask_token_id(self) -> int | None:
        """Target vocabulary id of the MASK token; ``None`` selects the learned ``mask_embedding``."""
        return self.dflash_config.get("mask_token_id")

    @mask_token_id.setter
    def mask_token_id(self, value: int | None):
        self.dflash_config = {**(self.dflash_config or {}), "mask_token_id": value}

    @property
    def target_layer_ids(self) -> list[int] | None:
        """Target layers whose outputs are concatenated into the context features (n of them; ``fc`` is n·H → H)."""
        return self.dflash_config.get("target_layer_ids")

    @target_layer_ids.setter
    def target_layer_ids(self, value: list[int] | None):
        self.dflash_config = {**(self.dflash_config or {}), "target_layer_ids": value}

    @classmethod
    def from_target_config(
        cls,
        target_config,
        num_hidden_layers: int = 5,
        block_size: int = 16,
        mask_token_id: int | None = None,
        target_layer_ids: list[int] | None = None,
        **overrides,
    ) -> DFlashConfig:
        """A drafter config shaped for ``target_config`` (Llama, Mistral, Gemma3, GPT-OSS, Qwen3, Qwen3-MoE, Qwen3-Next,
        Qwen3.5 and Qwen3.5-MoE text or multimodal wrapper, Kimi Linear).

        Copies hidden/vocab/FFN sizes, attention heads and head dim, norm eps, RoPE frequencies and maximum positions
        from the target's decoder config (a target with RoPE per layer type: its full-attention layers'; a latent
        attention target, Kimi Linear: hidden / heads for the head dim, its ``head_dim`` being the RoPE part). The
        drafter is dense: a MoE target gives it its dense ``intermediate_size`` where the config has one (Qwen3-MoE,
        Qwen3-Next, Kimi Linear), else 4 × hidden (Qwen3.5-MoE has none). The target's partial / multimodal RoPE
        settings are dropped: the drafter rotates its full head dim. ``target_layer_ids`` defaults to
        ``num_hidden_layers`` layers spread by :func:`dflash_target_layer_ids`. With ``mask_token_id=None`` the
        drafter gets a learned ``mask_embedding``.
        Any config field can be overridden through ``overrides`` (e.g. z-lab's Qwen3.6-27B drafter uses
        ``num_attention_heads=32, num_key_value_heads=8, head_dim=128`` where the target has 24 / 4 / 256).
        """
        text = _text_config(target_config)
        for name in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads"):
            if getattr(text, name, None) is None:
                raise ValueError(f"target config {type(text).__name__} has no `{name}`; cannot derive a drafter")
        num_target = text.num_hidden_layers
        if target_layer_ids is None:
            target_layer_ids = dflash_target_layer_ids(num_target, num_hidden_layers)
        target_layer_ids = [int(i) for i in target_layer_ids]
        if not target_layer_ids:
            raise ValueError("target_layer_ids must not be empty")
        bad = [i for i in target_layer_ids if not 0 <= i < num_target]
        if bad:
            raise ValueError(f"target_layer_ids {bad} out of range for a {num_target}-layer target")
        if len(set(target_layer_ids)) != len(target_layer_ids):
            raise ValueError(f"target_layer_ids must be distinct, got {target_layer_ids}")
        if mask_token_id is not None and not 0 <= mask_token_id < text.vocab_size:
            raise ValueError(f"mask_token_id {mask_token_id} outside the target vocabulary (size {text.vocab_size})")

        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        if getattr(text, "kv_lora_rank", None):
            # MLA's head_dim is a latent head's RoPE part: hidden / heads keeps q/o square (a 192-dim MLA q head: 2.7×)
            head_dim = text.hidden_size // heads
        rope = dict(getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
        if isinstance(rope.get("full_attention"), dict):  # per-layer-type RoPE (Gemma3): the full layers' schedule
            rope = dict(rope["full_attention"])
        for key in _TARGET_ONLY_ROPE_KEYS:
            rope.pop(key, None)
        fields = dict(
            hidden_size=text.hidden_size,
            vocab_size=text.vocab_size,
            intermediate_size=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            hidden_act=getattr(text, "hidden_act", "silu"),
            rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
            max_position_embeddings=getattr(text, "max_position_embeddings", 32768),
            rope_parameters=rope,
            attention_bias=False,
            tie_word_embeddings=False,
            bos_token_id=getattr(text, "bos_token_id", None),
            eos_token_id=getattr(text, "eos_token_id", None),
            pad_token_id=getattr(text, "pad_token_id", None),
            block_size=block_size,
            num_target_layers=num_target,
            dflash_config={"mask_token_id": mask_token_id, "target_layer_ids": target_layer_ids},
        )
        fields.update(overrides)
        if fields["hidden_size"] != text.hidden_size:
            raise ValueError(
                f"the drafter's hidden_size must equal the target's ({text.hidden_size}): it reads the target's "
                "embeddings and feeds the target's lm_head"
            )
        return cls(**fields)


DFlashConfig.register_for_auto_class("AutoConfig")

__all__ = ["DFlashConfig", "dflash_target_layer_ids"]

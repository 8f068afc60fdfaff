"""Drafter training for a frozen target: DFlash (docs/DESIGN.md §2) and Weaver with DFlash frozen (§3).

**DFlash** (:func:`run_train_dflash`). Per sequence (chat-templated prompt + the target's own response):

* the frozen target runs once with ``output_hidden_states``; its features (``drafter.extract_context_features``) are
  computed on the fly (caching them would cost ``len(target_layer_ids)·H`` values per token: 5.8 kB/token in bf16 for
  SmolLM2, ~60 GB for 10 M tokens);
* ``--anchors`` positions (512, DFlash §4.2) are drawn without replacement among the response positions that have at
  least one following token; block j = the clean anchor token + MASK × (B-1) at positions ``anchor_j + 0..B-1``;
* all blocks of a sequence go through the drafter in one pass with
  :meth:`~modeling_weaver.modeling_dflash.DFlashDraftModel.block_attention_mask` (block j sees target features of
  positions ``< anchor_j`` and its own block, bidirectionally; nothing of other blocks);
* block position k (1..B-1) predicts token ``anchor + k`` through the **target's** frozen lm_head; cross entropy
  weighted ``w_k = exp(-(k-1)/γ)`` (γ = 7 for B = 16), averaged over valid positions;
* AdamW, lr 6e-4, cosine with 4 % warm-up, grad clip 1.0. The target (embedding, lm_head included) is frozen.

**Weaver** (:func:`run_train_weaver`). Same anchors and frozen DFlash pass (no grad); then per block, teacher forcing
along the target's realised continuation: the Weaver prompt is ``u0`` = the target's final hidden state at
``anchor-1`` plus the DFlash hidden states at block positions ``1..D`` (``D = min(B-1, K)``), the nodes are the
tokens ``x[anchor + t]`` (t = 0..D-1, node t at depth t), and node t scores the top-``pool`` DFlash candidates of
depth t+1. The target distribution at ``anchor + t`` restricted to that pool (renormalised) is the teacher:
``loss = (1-λ)·KL(p‖q) + λ·TV(p, q)`` (the "LK" mix, λ = ``--tv-weight``), depth-decayed like DFlash. AdamW (or Muon
for the matrices, ``--optimizer muon``), WSD schedule (warm-up, stable, linear decay over the last ``--decay``),
peak lr 2e-4.

**Both**: bf16 autocast on CUDA (fp32 master weights), ``--max-steps`` / ``--max-minutes`` (the schedule's progress is
the larger of the step and time fractions, so a time budget still decays the lr to its end), checkpoint every
``--save-every`` steps into ``--output-dir`` (``training_state.pt`` + the model in Hub layout via ``save_pretrained``,
``--save-dtype`` bf16 by default, plus a model-card README), ``--resume`` restores model, optimizer, step, elapsed
time and data order exactly. One process by default; DDP when started by ``torchrun`` (NCCL on CUDA, gloo on CPU),
where N ranks of batch B train exactly as one process of batch N·B: each sample's anchors are drawn from its position
in the global data order, not from its rank, and each rank's loss is normalised by the global batch's weight (so the
gradients DDP averages are those of the global mean); only rank 0 writes.

**On the lent GPU machine** (10-minute calls, machine kept only while warm): plan the whole run with
``--max-minutes`` (the schedule) and cut it into calls with ``--session-minutes`` + ``--resume``; keep the output
folder outside the repo (e.g. ``/tmp``): files there survive between back-to-back calls while the machine stays warm,
whereas the repo copy is replaced on every call (``scripts/train_smollm2.sh`` does all this). Files come back through ``$OUT`` only (≤ 8 files of
≤ 16 MiB): ``tar czf - dflash weaver | split -b 15M - $OUT/drafters.tgz.`` and ``cat drafters.tgz.* | tar xzf -``
here (a 5-layer SmolLM2 DFlash is 37 MB in bf16, its Weaver 6 MB).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..configuration_dflash import DFlashConfig
from ..configuration_weaver import WeaverConfig
from ..files import load_dict_file
from .data import TokenDataset, cli_entry, require_dir
from ..modeling_dflash import DFlashDraftModel
from ..modeling_weaver import WeaverModel
from ..output_dir import check_output
from .arguments import DEFAULT_DRAFTER_LAYERS, _add_common, add_train_dflash_arguments, add_train_weaver_arguments  # noqa: F401 (re-exported)
from .smollm2 import load_target, resolve_device, resolve_dtype

STATE_FILE = "training_state.pt"
LOG_FILE = "train_log.jsonl"

# ----------------------------------------------------------------------------------------------------------------------
# Runtime: device, DDP, autocast.
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def max_over_ranks(self, values: list[float]) -> list[float]:
        """Element-wise max over ranks (identity in a single process)."""
        if not self.distributed:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def barrier(self):
        if self.distributed:
            dist.barrier()

    def share(self, total: torch.Tensor) -> torch.Tensor:
        """``total`` summed over ranks, divided by the world size (detached): a rank whose loss is its own sum over
        this share holds its part of the global mean, since DDP averages the ranks' gradients. Itself in a single
        process. Every rank must call it (a collective)."""
        total = total.detach().clone()
        if self.distributed:
            dist.all_reduce(total)
            total /= self.world_size
        return total

    def mean_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        """Each value's mean over ranks (the metrics a log line reports); the same dict in a single process."""
        if not self.distributed or not values:
            return values
        t = torch.tensor(list(values.values()), dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return dict(zip(values, (t / self.world_size).tolist()))

    def autocast(self):
        """bf16 autocast on CUDA; nothing elsewhere (CPU runs stay fp32)."""
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()


def setup_runtime(device: str | None = None) -> Runtime:
    """Single process, or DDP when ``WORLD_SIZE > 1`` (torchrun): NCCL on CUDA, gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Runtime(rank, world, local_rank, dev)


def teardown_runtime(runtime: Runtime):
    if runtime.distributed and dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------------
# Batches, anchors, the frozen target and the block pass.
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class Batch:
    """Right-padded sequences: ``input_ids [B, T]``, ``lengths [B]``, ``prompt_lens [B]`` (response starts there)."""

    input_ids: torch.Tensor
    lengths: torch.Tensor
    prompt_lens: torch.Tensor

    def to(self, device) -> Batch:
        return Batch(self.input_ids.to(device), self.lengths.to(device), self.prompt_lens.to(device))


def collate(items: list[tuple[torch.Tensor, int]], pad_id: int = 0) -> Batch:
    width = max(ids.shape[0] for ids, _ in items)
    input_ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    for i, (ids, _) in enumerate(items):
        input_ids[i, : ids.shape[0]] = ids
    lengths = torch.tensor([ids.shape[0] for ids, _ in items])
    return Batch(input_ids, lengths, torch.tensor([p for _, p in items]))


def sample_anchors(batch: Batch, num_anchors: int,
                   generator: torch.Generator | list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """Random block anchors inside each response.

    Candidates of sequence b are positions ``max(prompt_len, 1) .. length - 2`` (a following token exists and the
    context is non-empty); ``min(num_anchors, #candidates)`` are drawn without replacement, sorted. ``generator``: one
    for the batch, or one per sequence (the training loop's: a sample's anchors then do not depend on its batch-mates).

    Returns:
        ``anchors [B, nb]`` long and ``valid [B, nb]`` bool (padding anchors repeat a real one and are invalid).
    """
    rows = []
    gens = generator if isinstance(generator, (list, tuple)) else [generator] * batch.lengths.shape[0]
    if len(gens) != batch.lengths.shape[0]:
        raise ValueError(f"sample_anchors: {len(gens)} generators for {batch.lengths.shape[0]} sequences")
    for length, plen, gen in zip(batch.lengths.tolist(), batch.prompt_lens.tolist(), gens):
        lo, hi = max(plen, 1), length - 1  # anchors in [lo, hi)
        count = max(0, hi - lo)
        pick = torch.randperm(count, generator=gen)[:num_anchors] + lo if count else torch.zeros(0).long()
        rows.append(pick.sort().values)
    nb = max(1, max(len(r) for r in rows))
    anchors = torch.ones(len(rows), nb, dtype=torch.long)
    valid = torch.zeros(len(rows), nb, dtype=torch.bool)
    for i, r in enumerate(rows):
        anchors[i, : len(r)] = r
        anchors[i, len(r) :] = r[0] if len(r) else 1
        valid[i, : len(r)] = True
    return anchors.to(batch.input_ids.device), valid.to(batch.input_ids.device)


@torch.no_grad()
def target_states(target, batch: Batch, drafter: DFlashDraftModel) -> tuple[torch.Tensor, torch.Tensor]:
    """One frozen target pass. Returns the drafter's context features ``[B, T, n·H]`` and the final-normed hidden
    states ``[B, T, H]`` (the lm_head input; Weaver's ``u0``)."""
    width = batch.input_ids.shape[1]
    mask = (torch.arange(width, device=batch.input_ids.device)[None] < batch.lengths[:, None]).long()
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    out = decoder(input_ids=batch.input_ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    return drafter.extract_context_features(out.hidden_states), out.hidden_states[-1]


class BlockDrafting(nn.Module):
    """Trainable wrapper (what DDP wraps): all anchored blocks of a batch through the DFlash drafter in one pass."""

    def __init__(self, drafter: DFlashDraftModel):
        super().__init__()
        self.drafter = drafter

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor,
                embed_tokens: nn.Module) -> torch.Tensor:
        """
        Args:
            input_ids: ``[B, T]``; features: ``[B, T, n·H]`` target features of every position.
            anchors: ``[B, nb]`` block anchors; embed_tokens: the target's (frozen) input embedding.
        Returns:
            ``[B, nb, S, H]`` drafter hidden states; ``[:, :, k]`` predicts token ``anchor + k``.
        """
        drafter = self.drafter
        bsz, width = input_ids.shape
        nb, size = anchors.shape[1], drafter.block_size
        block = drafter.block_embeddings(input_ids.gather(1, anchors).reshape(-1), embed_tokens)  # [B·nb, S, H]
        block = block.reshape(bsz, nb * size, -1)
        positions = torch.cat([
            torch.arange(width, device=input_ids.device).expand(bsz, width),
            (anchors[:, :, None] + torch.arange(size, device=input_ids.device)).reshape(bsz, nb * size),
        ], dim=1)
        mask = DFlashDraftModel.block_attention_mask(anchors, width, size)
        hidden = drafter(noise_embedding=block, target_hidden=features, position_ids=positions, attention_mask=mask)
        return hidden.view(bsz, nb, size, -1)


@torch.no_grad()
def init_from_target_layers(drafter: DFlashDraftModel, target) -> list[int]:
    """Start the drafter's decoder layers from the target's last ``num_hidden_layers`` layers (and its final norm).

    The drafter then begins with layers that already read and write the target's residual space, and its output
    already suits the target's lm_head: on SmolLM2 this cut the steps to a given loss several-fold. Parameters
    absent from the target (e.g. ``q_norm``/``k_norm`` for Llama targets) keep their init.

    Returns:
        the target layer indices copied (one per drafter layer).
    Raises:
        ValueError: the target's layers do not have the drafter layers' shapes.
    """
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    source = list(decoder.layers)[-len(drafter.layers):]
    copied = []
    for layer, src in zip(drafter.layers, source):
        theirs = dict(src.named_parameters())
        for name, param in layer.named_parameters():
            if name in theirs:
                if theirs[name].shape != param.shape:
                    raise ValueError(f"cannot start the drafter from target layers: {name} is "
                                     f"{tuple(theirs[name].shape)} in the target, {tuple(param.shape)} in the drafter")
                param.copy_(theirs[name].to(param.dtype))
        copied.append(src.self_attn.layer_idx if hasattr(src.self_attn, "layer_idx") else None)
    if getattr(decoder, "norm", None) is not None and decoder.norm.weight.shape == drafter.norm.weight.shape:
        drafter.norm.weight.copy_(decoder.norm.weight.to(drafter.norm.weight.dtype))
    return copied


@torch.no_grad()
def grow_drafter(drafter: DFlashDraftModel, num_layers: int, target) -> DFlashDraftModel:
    """A deeper drafter that computes what ``drafter`` computes: its layers become the last ones, and the new first
    layers start from the target's layers just before those :func:`init_from_target_layers` would pick, with their
    output projections (``o_proj``, ``down_proj``) zeroed so that each new layer starts as the identity (the residual
    passes through). Training then gives the new layers their say from the trained drafter's accuracy instead of from
    scratch. Context features (``fc``, ``target_layer_ids``), norms and the mask embedding are kept.

    Raises:
        ValueError: ``num_layers`` is below the drafter's depth, or the target's layers do not fit the drafter's.
    """
    old = drafter.config.num_hidden_layers
    if num_layers < old:
        raise ValueError(f"--num-layers {num_layers}: cannot shrink a {old}-layer drafter")
    if num_layers == old:
        return drafter
    extra = num_layers - old
    fields = drafter.config.to_dict()
    types = fields.get("layer_types")
    if types:  # the new layers attend like the drafter's first one
        fields["layer_types"] = [types[0]] * extra + list(types)
    grown = DFlashDraftModel(DFlashConfig.from_dict({**fields, "num_hidden_layers": num_layers}))
    grown.to(device=drafter.fc.weight.device, dtype=drafter.fc.weight.dtype)
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    if len(decoder.layers) < num_layers:
        raise ValueError(f"--num-layers {num_layers}: the target has only {len(decoder.layers)} layers to start from")
    init_from_target_layers(grown, target)  # (the new first layers keep this start; the others take the drafter's)
    mine = grown.state_dict()
    for name, value in drafter.state_dict().items():
        if name.startswith("layers."):
            index, rest = name[len("layers."):].split(".", 1)
            name = f"layers.{int(index) + extra}.{rest}"
        mine[name] = value
    for i in range(extra):
        for name in _RESIDUAL_OUTPUTS:
            mine[f"layers.{i}.{name}"] = torch.zeros_like(mine[f"layers.{i}.{name}"])
    grown.load_state_dict(mine)
    return grown


#: The projections that write a drafter layer's output into the residual stream: zero, the layer is the identity.
_RESIDUAL_OUTPUTS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def depth_weights(num: int, gamma: float | None, device=None) -> torch.Tensor:
    """``w_k = exp(-(k-1)/γ)`` for k = 1..num (all ones when γ is None or ≤ 0)."""
    k = torch.arange(num, dtype=torch.float32, device=device)
    return torch.ones_like(k) if not gamma or gamma <= 0 else torch.exp(-k / gamma)


def block_targets(batch: Batch, anchors: torch.Tensor, valid: torch.Tensor, depth: int):
    """Tokens ``x[anchor + k]`` for k = 1..depth: ``labels [B, nb, depth]`` and ``ok [B, nb, depth]``."""
    k = torch.arange(1, depth + 1, device=anchors.device)
    pos = anchors[:, :, None] + k  # [B, nb, depth]
    ok = valid[:, :, None] & (pos < batch.lengths[:, None, None])
    width = batch.input_ids.shape[1]
    labels = batch.input_ids.gather(1, pos.clamp(max=width - 1).flatten(1)).view_as(pos)
    return labels, ok


def block_teacher(final_hidden: torch.Tensor, anchors: torch.Tensor, depth: int) -> torch.Tensor:
    """The target's final hidden states at ``anchor + k - 1`` (k = 1..depth), which predict ``x[anchor + k]``:
    ``[B, nb, depth, H]`` (positions past the sequence are clamped; their labels are masked by ``ok``)."""
    pos = (anchors[:, :, None] + torch.arange(depth, device=anchors.device)).clamp(max=final_hidden.shape[1] - 1)
    return final_hidden.gather(1, pos.flatten(1)[..., None].expand(-1, -1, final_hidden.shape[-1])).view(
        *pos.shape, final_hidden.shape[-1])


def chain_tau(correct: torch.Tensor, ok: torch.Tensor) -> float:
    """Teacher-forced chain acceptance: 1 + mean length of the leading run of correct valid predictions per block."""
    run = (correct & ok).long().cumprod(-1).sum(-1).float() + 1  # [..., blocks]
    blocks = ok[..., 0]
    return float(run[blocks].mean()) if blocks.any() else float("nan")


# ----------------------------------------------------------------------------------------------------------------------
# Losses.
# ----------------------------------------------------------------------------------------------------------------------


def dflash_loss(hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor, ok: torch.Tensor,
                weights: torch.Tensor, teacher: torch.Tensor | None = None, kd_weight: float = 0.0,
                kd_topk: int = 32, share: Callable[[torch.Tensor], torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, dict]:
    """Position-decayed CE of block positions 1..S-1, optionally mixed with distillation from the target.

    Args:
        hidden: ``[B, nb, S, H]`` drafter output; labels, ok: ``[B, nb, S-1]``; weights: ``[S-1]``.
        teacher: ``[B, nb, S-1, H]`` the target's final-normed hidden states that predict the same tokens (its own
            next-token distribution given the realised prefix), or None.
        kd_weight: λ of ``(1-λ)·CE + λ·KD`` where KD is the cross entropy to the target's distribution restricted to
            its ``kd_topk`` most likely tokens (renormalised): soft targets carry the target's ranking, and on
            sampled answers its mode rather than the sampled token.
        share: maps this batch's weight sum to the normaliser (DDP: :meth:`Runtime.share`, a collective, called on
            every rank); None: the sum itself.
    Returns:
        scalar loss (weighted mean over valid positions) and metrics (``acc1`` = depth-1 accuracy, ``tau`` =
        teacher-forced chain acceptance, ``kd`` when distilling).
    """
    h = hidden[:, :, 1:][ok]  # only valid positions reach the (large) vocabulary projection
    w = weights.expand(ok.shape)[ok]
    total = w.sum() if share is None else share(w.sum())
    if h.shape[0] == 0:  # (the metrics every batch reports, so that ranks average the same keys)
        return hidden.sum() * 0.0, {"ce": 0.0, "acc1": 0.0, "tau": 0.0, **({"kd": 0.0} if teacher is not None
                                                                            and kd_weight > 0 else {})}
    logits = lm_head(h.to(lm_head.weight.dtype)).float()
    ce = F.cross_entropy(logits, labels[ok], reduction="none")
    per_token, metrics = ce, {}
    if teacher is not None and kd_weight > 0:
        with torch.no_grad():
            top = lm_head(teacher[ok].to(lm_head.weight.dtype)).float().topk(kd_topk, dim=-1)
            p = torch.softmax(top.values, -1)
        kd = -(p * torch.log_softmax(logits, -1).gather(-1, top.indices)).sum(-1)
        per_token = (1 - kd_weight) * ce + kd_weight * kd
        metrics["kd"] = float(kd.detach().mean())
    loss = (per_token * w).sum() / total
    with torch.no_grad():
        correct = torch.zeros_like(ok)
        correct[ok] = logits.argmax(-1) == labels[ok]
        acc1 = correct[..., 0][ok[..., 0]].float().mean()
    return loss, {"ce": float(ce.detach().mean()), "acc1": float(acc1), "tau": chain_tau(correct, ok), **metrics}


def lk_loss(scores: torch.Tensor, target_logits: torch.Tensor, ok: torch.Tensor, weights: torch.Tensor,
            tv_weight: float, share: Callable[[torch.Tensor], torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(1-λ)·KL(p‖q) + λ·TV(p, q)`` over the candidate pool, depth-weighted mean over valid nodes.

    Args:
        scores: ``[M, D, P]`` Weaver logits of the pool (q = softmax); target_logits: ``[M, D, P]`` the target's
            logits of the same tokens (p = softmax, i.e. the target distribution restricted to the pool).
        ok: ``[M, D]``; weights: ``[D]``.
        share: as :func:`dflash_loss`'s.
    Returns:
        loss, and the per-node KL and TV ``[M, D]`` (detached).
    """
    logq = torch.log_softmax(scores.float(), -1)
    logp = torch.log_softmax(target_logits.float(), -1)
    p = logp.exp()
    kl = (p * (logp - logq)).sum(-1)
    tv = 0.5 * (p - logq.exp()).abs().sum(-1)
    per_node = (1 - tv_weight) * kl + tv_weight * tv
    w = weights.expand(ok.shape) * ok
    total = w.sum() if share is None else share(w.sum())
    loss = (per_node * w).sum() / total.clamp_min(1e-9)
    return loss, kl.detach(), tv.detach()


def pool_projection(x: torch.Tensor, pool_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight[pool_ids] · x`` in fp32: ``x [..., H]``, ``pool_ids [..., P]``, ``weight [V, H]`` → ``[..., P]``.

    Gathers the P rows per position (as :meth:`WeaverModel.candidate_logits` and the tree build do) when ``P·H < V``;
    otherwise projects onto the whole vocabulary and gathers — the same numbers with far less memory (SmolLM2:
    P·H = 295 k > V = 49 k; Qwen3.6-27B: 2.6 M > 248 k).
    """
    vocab, hdim = weight.shape
    if pool_ids.shape[-1] * hdim < vocab:
        return torch.matmul(weight[pool_ids], x.to(weight.dtype).unsqueeze(-1)).squeeze(-1).float()
    return torch.matmul(x.to(weight.dtype), weight.t()).gather(-1, pool_ids).float()


class WeaverTeacherForcing(nn.Module):
    """Trainable wrapper (what DDP wraps): Weaver scores of the candidate pools along teacher-forced chains."""

    def __init__(self, weaver: WeaverModel):
        super().__init__()
        self.weaver = weaver

    def forward(self, u0: torch.Tensor, draft_hidden: torch.Tensor, token_embeds: torch.Tensor,
                pool_ids: torch.Tensor, pool_logits: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """
        Args:
            u0: ``[M, d_model]``; draft_hidden: ``[M, D, d_model]``; token_embeds: ``[M, D, d_embed]`` (node t =
                token at depth t, root first); pool_ids / pool_logits: ``[M, D, P]`` DFlash candidates of depth t+1.
        Returns:
            ``[M, D, P]`` Weaver logits: ``pool_logits + E_lm[c] · query``, the values of
            :meth:`WeaverModel.candidate_logits` (computed through :func:`pool_projection`).
        """
        query = self.weaver(u0, draft_hidden, token_embeds)  # [M, D, d_model]
        return pool_logits.float() + pool_projection(query, pool_ids, lm_head_weight)


@dataclass
class TeacherPools:
    """Teacher-forced Weaver inputs of ``M`` valid blocks along the target's realised continuation (node t = token
    ``x[anchor + t]`` at depth t; shapes as in :meth:`WeaverTeacherForcing.forward`)."""

    u0: torch.Tensor  # [M, d_model] target final hidden state at anchor - 1
    draft_hidden: torch.Tensor  # [M, D, d_model] DFlash hidden states at block positions 1..D
    token_embeds: torch.Tensor  # [M, D, d_embed] the path tokens' target embeddings, root first
    pool_ids: torch.Tensor  # [M, D, P] top-P DFlash candidates of depth t + 1, best first
    pool_logits: torch.Tensor  # [M, D, P] their DFlash logits
    target_pool: torch.Tensor  # [M, D, P] the target's logits of the same tokens (the teacher)
    labels: torch.Tensor  # [M, D] the realised token at depth t + 1
    ok: torch.Tensor  # [M, D] that token exists


@torch.no_grad()
def teacher_pools(target, drafting: BlockDrafting, batch: Batch, anchors: torch.Tensor, valid: torch.Tensor,
                  depth: int, pool: int, states: tuple[torch.Tensor, torch.Tensor] | None = None) -> TeacherPools:
    """One frozen target pass (or its :func:`target_states` of ``batch``, given as ``states``) and DFlash pass over
    ``batch`` → :class:`TeacherPools` of the ``valid`` anchors."""
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    features, final = states if states is not None else target_states(target, batch, drafting.drafter)
    hidden = drafting(batch.input_ids, features, anchors, embed)[valid]  # [M, S, H]
    a = anchors[valid]  # [M]
    rows = torch.arange(anchors.shape[0], device=a.device)[:, None].expand_as(anchors)[valid]  # [M]
    draft_hidden = hidden[:, 1 : depth + 1]
    pool_logits, pool_ids = lm_head(draft_hidden.to(lm_head.weight.dtype)).float().topk(pool, dim=-1)
    t = torch.arange(depth, device=a.device)
    width = batch.input_ids.shape[1]
    node_pos = (a[:, None] + t).clamp(max=width - 1)  # [M, D]
    ok = (a[:, None] + t + 1) < batch.lengths[rows][:, None]
    return TeacherPools(
        u0=final[rows, a - 1],
        draft_hidden=draft_hidden,
        token_embeds=embed(batch.input_ids[rows[:, None], node_pos]),
        pool_ids=pool_ids,
        pool_logits=pool_logits,
        # The target's logits at the node positions, restricted to each node's pool (the teacher p).
        target_pool=pool_projection(final[rows[:, None], node_pos], pool_ids, lm_head.weight),
        labels=batch.input_ids[rows[:, None], (node_pos + 1).clamp(max=width - 1)],
        ok=ok,
    )


def pool_hits(scores: torch.Tensor, tp: TeacherPools) -> dict[str, torch.Tensor]:
    """``[M, D]`` bools: Weaver's best candidate is the realised token (``weaver``), DFlash's is (``dflash``), the
    token is in the pool at all (``pool``)."""
    return {"weaver": tp.pool_ids.gather(-1, scores.argmax(-1, keepdim=True))[..., 0] == tp.labels,
            "dflash": tp.pool_ids[..., 0] == tp.labels,
            "pool": (tp.pool_ids == tp.labels[..., None]).any(-1)}


@torch.no_grad()
def acceptance_profile(target, drafter: DFlashDraftModel, weaver: WeaverModel | None,
                       sequences: list[tuple[torch.Tensor, int]], anchors_per_pass: int = 64,
                       topk: int = 8) -> list[dict]:
    """Teacher-forced accuracy per depth at every response position of ``sequences`` (the target's own
    continuations: prompt ids + greedy response, with the prompt length): what limits a tree built from these
    drafters, without building one.

    For each depth d = 1..D, over the anchors whose token ``x[anchor + d]`` exists:

    * ``dflash`` / ``weaver``: the top candidate at depth d is the realised token (Weaver teacher-forced along the
      realised path, DFlash's marginal);
    * ``dflash_reach`` / ``weaver_reach``: the chain of top candidates is right at every depth ≤ d (what a chain
      of that proposal accepts);
    * ``dflash_given`` / ``weaver_given``: accuracy at depth d given the chain was right before it;
    * ``dflash_topk``: the realised token is among DFlash's ``topk`` best at depth d (a tree's room to branch);
    * ``pool``: the realised token is in the candidate pool at all (the ceiling of any Weaver tree).

    Returns:
        one dict per depth (``depth``, ``count`` and the fractions above), and a last ``depth = "τ"`` row with the
        teacher-forced chain acceptances ``dflash`` / ``weaver`` (1 + mean leading run).
    """
    drafting = BlockDrafting(drafter)
    lm_head = target.get_output_embeddings()
    depth = drafter.block_size - 1 if weaver is None else min(drafter.block_size - 1, weaver.config.K)
    pool = lm_head.weight.shape[0] if weaver is None else min(weaver.config.candidate_pool_size,
                                                               lm_head.weight.shape[0])
    forcing = WeaverTeacherForcing(weaver) if weaver is not None else None
    device = lm_head.weight.device
    hits: dict[str, list[torch.Tensor]] = {}
    oks = []
    for sequence in sequences:  # one at a time, its anchors in passes (a pass costs (context + blocks)² attention)
        batch = collate([sequence]).to(device)
        every, valid = sample_anchors(batch, batch.input_ids.shape[1], torch.Generator().manual_seed(0))
        states = target_states(target, batch, drafter)  # once per sequence, shared by its passes
        for j in range(0, every.shape[1], anchors_per_pass):
            anchors = every[:, j : j + anchors_per_pass]
            tp = teacher_pools(target, drafting, batch, anchors, valid[:, j : j + anchors_per_pass], depth, pool,
                               states)
            scores = (forcing(tp.u0, tp.draft_hidden, tp.token_embeds, tp.pool_ids, tp.pool_logits, lm_head.weight)
                      if forcing is not None else tp.pool_logits)
            row = pool_hits(scores, tp)
            row["dflash_topk"] = (tp.pool_ids[..., :topk] == tp.labels[..., None]).any(-1)
            for k, v in row.items():
                hits.setdefault(k, []).append(v.cpu())
            oks.append(tp.ok.cpu())
    ok = torch.cat(oks)
    hit = {k: torch.cat(v) & ok for k, v in hits.items()}
    reach = {k: hit[k].long().cumprod(-1).bool() for k in ("dflash", "weaver")}
    rows = []
    for d in range(depth):
        n = int(ok[:, d].sum())
        if n == 0:
            break
        row = {"depth": d + 1, "count": n}
        for k in ("dflash", "weaver", "dflash_topk", "pool"):
            row[k] = float(hit[k][:, d].sum()) / n
        for k in ("dflash", "weaver"):
            row[f"{k}_reach"] = float(reach[k][:, d].sum()) / n
            before = ok[:, d] & (reach[k][:, d - 1] if d else torch.ones_like(ok[:, d]))
            row[f"{k}_given"] = float(hit[k][:, d][before].sum()) / max(1, int(before.sum()))
        rows.append(row)
    rows.append({"depth": "τ", "count": int(ok[:, 0].sum()), "dflash": chain_tau(hit["dflash"], ok),
                 "weaver": chain_tau(hit["weaver"], ok)})
    return rows


# ----------------------------------------------------------------------------------------------------------------------
# Schedules, optimizers, checkpoints.
# ----------------------------------------------------------------------------------------------------------------------


def cosine_schedule(progress: float, warmup: float) -> float:
    """Linear warm-up over the first ``warmup`` fraction, then cosine to 0."""
    if progress < warmup:
        return progress / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / max(1e-9, 1 - warmup))))


def constant_schedule(progress: float, warmup: float) -> float:
    """Linear warm-up, then constant: runs that continue across calls and sessions (weights averaged by EMA)."""
    return min(1.0, progress / warmup) if warmup > 0 else 1.0


def wsd_schedule(progress: float, warmup: float, decay: float) -> float:
    """Warm-up, stable at 1, linear decay to 0 over the last ``decay`` fraction."""
    if progress < warmup:
        return progress / warmup
    if progress < 1 - decay:
        return 1.0
    return max(0.0, (1 - progress) / max(1e-9, decay))


def dflash_schedule(args) -> Callable[[float], float]:
    """The DFlash trainer's lr factor against progress, from ``--schedule`` (``--warmup``, ``--decay``)."""
    if args.schedule == "constant":
        return lambda p: constant_schedule(p, args.warmup)
    if args.schedule == "wsd":
        return lambda p: wsd_schedule(p, args.warmup, args.decay)
    return lambda p: cosine_schedule(p, args.warmup)


def build_optimizers(model: nn.Module, lr: float, weight_decay: float, kind: str = "adamw") -> list:
    """AdamW (β = 0.9, 0.95; no decay on norms and biases), or Muon for 2-D matrices + AdamW for the rest."""
    decay, no_decay, matrices = [], [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if kind == "muon" and p.ndim == 2:
            matrices.append(p)
        elif p.ndim >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    opts = [torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))]
    if matrices:
        if not hasattr(torch.optim, "Muon"):
            raise RuntimeError("--optimizer muon needs torch >= 2.9 (torch.optim.Muon)")
        opts.append(torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw"))
    for opt in opts:
        for g in opt.param_groups:
            g["base_lr"] = lr
    return opts


def save_hub(model, out_dir: Path, dtype: torch.dtype, card: str, weights: list[torch.Tensor] | None = None):
    """``save_pretrained`` (config with auto_map, code files, safetensors) of a ``dtype`` copy + a model-card README.

    A copy, so the fp32 master weights stay untouched (and ``config.json`` states the saved dtype); ``weights``
    (e.g. the EMA) replace the trainable parameters in the copy."""
    saved = copy.deepcopy(model)
    if weights is not None:
        with torch.no_grad():
            for param, value in zip([p for p in saved.parameters() if p.requires_grad], weights):
                param.copy_(value)
    saved.to(dtype).save_pretrained(out_dir)
    (out_dir / "README.md").write_text(card)


class WeightAverage:
    """Exponential moving average of the trainable parameters, decay ``min(decay, (1 + t) / (10 + t))`` at update t
    (short runs are not dominated by the starting weights). With a constant lr it stands in for the lr decay a run
    continued across calls never gets."""

    def __init__(self, params: list[torch.Tensor], decay: float):
        self.decay, self.updates = decay, 0
        self.weights = [p.detach().clone() for p in params]

    @torch.no_grad()
    def update(self, params: list[torch.Tensor]):
        beta = min(self.decay, (1 + self.updates) / (10 + self.updates))
        torch._foreach_lerp_(self.weights, [p.detach() for p in params], 1 - beta)
        self.updates += 1

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates, "weights": self.weights}

    def load_state_dict(self, state: dict):
        self.updates = state["updates"]
        for mine, saved in zip(self.weights, state["weights"]):
            mine.copy_(saved)


# ----------------------------------------------------------------------------------------------------------------------
# The loop shared by both trainers.
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class LoopSpec:
    """What differs between the trainers."""

    name: str  # "dflash" | "weaver"
    model: nn.Module  # the PreTrainedModel being trained (saved)
    wrapper: nn.Module  # module whose forward the step calls (DDP wraps it)
    step: Callable  # (wrapped module, Batch, a generator per sequence) -> (loss, metrics)
    schedule: Callable[[float], float]
    optimizer_kind: str
    card: Callable[[dict], str]  # final metrics -> model-card text
    decay_start: float | None = None  # progress where the lr decay starts (WSD), for --save-before-decay


class Schedule:
    """Where training stands: steps and elapsed time (across resumes) → progress in [0, 1]."""

    def __init__(self, total_steps: int, max_minutes: float | None):
        self.total_steps, self.budget = total_steps, (None if max_minutes is None else 60.0 * max_minutes)

    def progress(self, step: int, elapsed: float) -> float:
        p = step / self.total_steps
        if self.budget:
            p = max(p, elapsed / self.budget)
        return min(1.0, p)


def _batch_positions(step: int, micro: int, accum: int, runtime: Runtime, batch_size: int) -> range:
    """This rank's positions in the global data order: a global batch is the ranks' batches in rank order, so N
    ranks of batch B read what one process of batch N·B reads."""
    base = ((step * accum + micro) * runtime.world_size + runtime.rank) * batch_size
    return range(base, base + batch_size)


def _batch_indices(positions: range, n: int, seed: int, perms: dict) -> list[int]:
    """Deterministic data order: epoch e is ``randperm(n)`` seeded by ``seed + e``; consumed in global order."""
    out = []
    for g in positions:
        epoch = g // n
        if epoch not in perms:
            perms[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        out.append(perms[epoch][g % n])
    return out


def train_loop(args, spec: LoopSpec, dataset: TokenDataset, runtime: Runtime, pad_id: int) -> dict:
    """Optimise ``spec.model`` until ``--max-steps`` / epochs / ``--max-minutes``; checkpoints and resume.

    Returns the last logged metrics.
    """
    from tqdm.auto import tqdm

    out_dir = Path(args.output_dir)
    model, wrapper = spec.model, spec.wrapper
    model.to(runtime.device).train()
    wrapper.to(runtime.device)
    if runtime.distributed:
        ids = [runtime.device.index] if runtime.device.type == "cuda" else None
        wrapper = nn.parallel.DistributedDataParallel(wrapper, device_ids=ids)
    opts = build_optimizers(model, args.lr, args.weight_decay, spec.optimizer_kind)
    params = [p for p in model.parameters() if p.requires_grad]
    step, elapsed = 0, 0.0
    if args.resume:
        state = load_training_state(out_dir / STATE_FILE, map_location=runtime.device)
        file = out_dir / STATE_FILE
        try:
            model.load_state_dict(state["model"])
        except RuntimeError as err:
            raise ValueError(f"{file}: field 'model' does not fit the model being trained: {err}") from err
        if len(state["optimizers"]) != len(opts):
            raise ValueError(f"{file}: field 'optimizers' holds {len(state['optimizers'])} optimiser state(s), this "
                             f"run has {len(opts)} (another --optimizer?)")
        for opt, sd in zip(opts, state["optimizers"]):
            try:
                opt.load_state_dict(sd)
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{file}: field 'optimizers' does not fit this run's optimiser: {err}") from err
        step, elapsed = state["step"], state["elapsed"]
    ema = WeightAverage(params, args.ema) if args.ema else None
    if ema is not None and args.resume and state.get("ema") is not None:
        ema.load_state_dict(state["ema"])

    global_batch = args.batch_size * args.grad_accum * runtime.world_size
    total = args.max_steps or max(1, math.ceil(args.epochs * len(dataset) / global_batch))
    schedule = Schedule(total, args.max_minutes)
    perms: dict = {}
    metrics: dict = {}
    log = open(out_dir / LOG_FILE, "a", encoding="utf-8") if runtime.is_main else None

    def save():
        if runtime.is_main:
            torch.save({"step": step, "elapsed": elapsed, "model": model.state_dict(),
                        "optimizers": [o.state_dict() for o in opts], "config": model.config.to_dict(),
                        "ema": None if ema is None else ema.state_dict(),
                        "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, list, bool))}},
                       out_dir / (STATE_FILE + ".tmp"))
            os.replace(out_dir / (STATE_FILE + ".tmp"), out_dir / STATE_FILE)
            save_hub(model, out_dir, getattr(torch, args.save_dtype), spec.card(
                {"step": step, "minutes": round(elapsed / 60, 2), "samples": len(dataset),
                 "tokens": dataset.num_tokens, "world_size": runtime.world_size,
                 **({} if ema is None else {"weights": f"EMA (decay {ema.decay})"}), **metrics}),
                weights=None if ema is None else ema.weights)
        runtime.barrier()

    if not 0 <= getattr(args, "decay", 0) < 1:
        raise ValueError(f"--decay must be in [0, 1), got {args.decay}")
    if args.save_before_decay and spec.decay_start is None:
        raise ValueError("--save-before-decay needs a schedule with a final decay (train-dflash: --schedule wsd)")
    pre_decay = out_dir / "pre_decay"

    def save_pre_decay():  # once per run (resumes included): the weights at the start of the decay
        if runtime.is_main and not (pre_decay / "config.json").exists():
            save_hub(model, pre_decay, getattr(torch, args.save_dtype), spec.card(
                {"step": step, "minutes": round(elapsed / 60, 2), "weights": "before the lr decay" + (
                    "" if ema is None else f", EMA (decay {ema.decay})")}), weights=None if ema is None else ema.weights)
        runtime.barrier()

    bar = tqdm(total=total, initial=step, desc=f"train {spec.name}", disable=not runtime.is_main or args.no_progress)
    start = time.monotonic() - elapsed
    session_end = None if args.session_minutes is None else time.monotonic() + 60 * args.session_minutes
    saved_at = step
    tokens, first = 0, (step, elapsed)  # this session's sequence tokens (all ranks), for tokens/s
    while step < total and schedule.progress(step, elapsed) < 1.0:
        if args.stop_at_step is not None and step >= args.stop_at_step:
            break
        if session_end is not None and runtime.max_over_ranks([float(time.monotonic() > session_end)])[0]:
            break
        if args.save_before_decay and schedule.progress(step + 1, elapsed) >= spec.decay_start:
            save_pre_decay()
        factor = spec.schedule(schedule.progress(step + 1, elapsed))
        for opt in opts:
            for g in opt.param_groups:
                g["lr"] = g["base_lr"] * factor
        running: dict = {"tokens": 0.0}
        for micro in range(args.grad_accum):
            positions = _batch_positions(step, micro, args.grad_accum, runtime, args.batch_size)
            idx = _batch_indices(positions, len(dataset), args.seed, perms)
            batch = collate([dataset[i] for i in idx], pad_id)
            running["tokens"] += float(batch.lengths.sum())  # (counted on the host, before the copy: no sync)
            batch = batch.to(runtime.device)
            gen = [torch.Generator().manual_seed(args.seed * 1_000_003 + g) for g in positions]
            sync = micro == args.grad_accum - 1 or not runtime.distributed
            with (contextlib.nullcontext() if sync else wrapper.no_sync()), runtime.autocast():
                loss, m = spec.step(wrapper, batch, gen)
            (loss / args.grad_accum).backward()
            for k, v in {"loss": float(loss.detach()), **m}.items():
                running[k] = running.get(k, 0.0) + v / args.grad_accum
        running = runtime.mean_over_ranks(running)  # (the loss: the global batch's, each rank holding its share)
        tokens += round(running.pop("tokens") * runtime.world_size)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.clip) if args.clip > 0 else torch.tensor(0.0)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if ema is not None:
            ema.update(params)
        step += 1
        elapsed = runtime.max_over_ranks([time.monotonic() - start])[0]
        metrics = {k: round(v, 5) for k, v in running.items()}
        metrics.update(lr=opts[0].param_groups[0]["lr"], grad_norm=round(float(grad_norm), 4))
        if log is not None and (step % args.log_every == 0 or step == 1):
            log.write(json.dumps({"step": step, "elapsed": round(elapsed, 2), "tokens": tokens, **metrics}) + "\n")
            log.flush()
        bar.update(1)
        bar.set_postfix({k: metrics[k] for k in ("loss", "tau", "tau_weaver", "lr") if k in metrics})
        if args.save_every and step % args.save_every == 0:
            save()
            saved_at = step
    bar.close()
    if saved_at != step or not (out_dir / STATE_FILE).exists():
        save()
    if log is not None:
        log.close()
    if runtime.is_main:
        rate = tokens / max(elapsed - first[1], 1e-9)
        print(f"{spec.name}: {step} steps in {elapsed / 60:.1f} min (world size {runtime.world_size}; this session "
              f"{step - first[0]} steps, {tokens} tokens, {rate:.0f} tokens/s), last metrics {json.dumps(metrics)} → "
              f"{out_dir}")
    return metrics


# ----------------------------------------------------------------------------------------------------------------------
# The two trainers.
# ----------------------------------------------------------------------------------------------------------------------


def _common_setup(args):
    out_dir = Path(args.output_dir)
    # checked by every rank before the process group forms: none waits for a failed one
    if not args.resume and (out_dir / STATE_FILE).exists():
        raise ValueError(f"{out_dir} already holds a training run: pass --resume, or choose another --output-dir")
    if args.resume and not (out_dir / STATE_FILE).exists():
        raise FileNotFoundError(f"--resume: no {STATE_FILE} in {out_dir}")
    if not args.resume:  # a fresh run writes config.json, README.md, ...: only into a new or empty folder
        check_output(out_dir, [args.data, args.target, getattr(args, "drafter", None), args.init_from], flag=None)
    runtime = setup_runtime(args.device)
    if runtime.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
    runtime.barrier()
    torch.manual_seed(args.seed)
    try:
        dataset = TokenDataset(args.data, max_length=args.max_length)
        target, tokenizer = load_target(args.target, dtype=resolve_dtype(args.target_dtype, runtime.device),
                                        device=runtime.device)
    except BaseException:
        teardown_runtime(runtime)
        raise
    target.requires_grad_(False)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return runtime, target, dataset, pad_id


def _saved_config(args, config_cls):
    """On ``--resume`` the model is rebuilt from the config stored with the training state."""
    file = Path(args.output_dir) / STATE_FILE
    state = load_training_state(file, map_location="cpu")
    try:
        return config_cls.from_dict(state["config"])
    except (TypeError, ValueError, KeyError, IndexError) as err:
        raise ValueError(f"{file}: field 'config' does not describe a {config_cls.__name__}: {err}") from err


#: The fields of ``training_state.pt`` and the types they must have.
STATE_FIELDS = {"step": int, "elapsed": (int, float), "model": dict, "optimizers": list, "config": dict,
                "ema": (dict, type(None)), "args": dict}


def load_training_state(file, map_location="cpu") -> dict:
    """``training_state.pt`` read without executing code (``torch.load(weights_only=True)``: tensors and plain
    containers only, a pickle that names any other callable is refused) and checked field by field; errors name the
    file and the field."""
    file = Path(file)
    state = load_dict_file(file, "a training state written by this package", STATE_FIELDS, map_location)
    for name, kind in STATE_FIELDS.items():
        if name not in state:
            raise ValueError(f"{file}: field '{name}' is missing")
        if not isinstance(state[name], kind) or isinstance(state[name], bool):
            raise ValueError(f"{file}: field '{name}' has type {type(state[name]).__name__}")
    if state["step"] < 0 or state["elapsed"] < 0:
        raise ValueError(f"{file}: field '{'step' if state['step'] < 0 else 'elapsed'}' is negative")
    bad = next((k for k, v in state["model"].items() if not isinstance(v, torch.Tensor)), None)
    if bad is not None:
        raise ValueError(f"{file}: field 'model' entry '{bad}' is not a tensor")
    return state


def _card(kind: str, args, extra: str) -> Callable[[dict], str]:
    def card(info: dict) -> str:
        rows = "\n".join(f"| {k} | {v} |" for k, v in info.items())
        return (
            f"---\nlibrary_name: transformers\ntags: [speculative-decoding, {kind}, modeling-weaver]\n---\n\n"
            f"# {kind} drafter for `{args.target}`\n\n{extra}\n\nTrained with modeling-weaver "
            f"(`weaver train-{kind}`), data `{args.data}`.\n\n```python\nfrom transformers import AutoModel\n"
            f"model = AutoModel.from_pretrained(path, trust_remote_code=True)\n```\n\n| | |\n|---|---|\n{rows}\n"
        )

    return card


@cli_entry
def run_train_dflash(args) -> int:
    require_dir(args.init_from, "--init-from")
    runtime, target, dataset, pad_id = _common_setup(args)
    try:
        if args.resume:
            drafter = DFlashDraftModel(_saved_config(args, DFlashConfig))
            if args.num_layers not in (None, drafter.config.num_hidden_layers):
                raise ValueError(f"--num-layers {args.num_layers}: the run in {args.output_dir} trains a "
                                 f"{drafter.config.num_hidden_layers}-layer drafter")
        elif args.init_from:
            drafter = DFlashDraftModel.from_pretrained(args.init_from, dtype=torch.float32)
            if args.num_layers is not None:
                drafter = grow_drafter(drafter, args.num_layers, target)
        else:
            config = DFlashConfig.from_target_config(
                target.config, num_hidden_layers=args.num_layers or DEFAULT_DRAFTER_LAYERS,
                block_size=args.block_size,
                mask_token_id=args.mask_token_id, target_layer_ids=args.target_layer_ids,
            )
            drafter = DFlashDraftModel(config)
            if not args.random_init:
                init_from_target_layers(drafter, target)
        drafter.float()
        embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        size = drafter.block_size
        weights = depth_weights(size - 1, args.gamma, runtime.device)

        def step(module, batch: Batch, gen: torch.Generator):
            features, final = target_states(target, batch, drafter)
            anchors, valid = sample_anchors(batch, args.anchors, gen)
            hidden = module(batch.input_ids, features, anchors, embed)
            labels, ok = block_targets(batch, anchors, valid, size - 1)
            teacher = block_teacher(final, anchors, size - 1) if args.kd_weight > 0 else None
            return dflash_loss(hidden, lm_head, labels, ok, weights, teacher, args.kd_weight, args.kd_topk,
                               share=runtime.share)

        n_params = sum(p.numel() for p in drafter.parameters())
        spec = LoopSpec(
            "dflash", drafter, BlockDrafting(drafter), step, dflash_schedule(args), "adamw",
            _card("dflash", args, f"DFlash block drafter: {drafter.config.num_hidden_layers} layers, block size "
                  f"{size}, target layers {drafter.config.target_layer_ids}, {n_params / 1e6:.1f} M parameters."),
            decay_start=1 - args.decay if args.schedule == "wsd" else None,
        )
        train_loop(args, spec, dataset, runtime, pad_id)
    finally:
        teardown_runtime(runtime)
    return 0


@cli_entry
def run_train_weaver(args) -> int:
    require_dir(args.drafter, "--drafter")
    require_dir(args.init_from, "--init-from")
    runtime, target, dataset, pad_id = _common_setup(args)
    try:
        drafter = DFlashDraftModel.from_pretrained(args.drafter, dtype=torch.float32).to(runtime.device).eval()
        drafter.requires_grad_(False)
        if args.resume:
            weaver = WeaverModel(_saved_config(args, WeaverConfig))
        elif args.init_from:
            weaver = WeaverModel.from_pretrained(args.init_from, dtype=torch.float32)
        else:
            weaver = WeaverModel(WeaverConfig.from_target_config(
                target.config, drafter.config, d_rank=args.d_rank, num_layers=args.num_layers,
                num_heads=args.num_heads, mlp_dim=args.mlp_dim, candidate_pool_size=args.pool,
            ))
        weaver.float()
        lm_head = target.get_output_embeddings()
        drafting = BlockDrafting(drafter)
        depth = min(drafter.block_size - 1, weaver.config.K)
        pool = min(weaver.config.candidate_pool_size, lm_head.weight.shape[0])
        weights = depth_weights(depth, args.gamma, runtime.device)

        def step(module, batch: Batch, gen: torch.Generator):
            anchors, valid = sample_anchors(batch, args.anchors, gen)
            tp = teacher_pools(target, drafting, batch, anchors, valid, depth, pool)
            scores = module(tp.u0, tp.draft_hidden, tp.token_embeds, tp.pool_ids, tp.pool_logits, lm_head.weight)
            loss, kl, tv = lk_loss(scores, tp.target_pool, tp.ok, weights, args.tv_weight, share=runtime.share)
            with torch.no_grad():
                hits = pool_hits(scores, tp)
                metrics = {"kl": float(kl[tp.ok].mean()), "tv": float(tv[tp.ok].mean()),
                           "tau_weaver": chain_tau(hits["weaver"], tp.ok),
                           "tau_dflash": chain_tau(hits["dflash"], tp.ok),
                           "pool_hit": float(hits["pool"][tp.ok].float().mean())}
            return loss, metrics

        n_params = sum(p.numel() for p in weaver.parameters())
        spec = LoopSpec(
            "weaver", weaver, WeaverTeacherForcing(weaver), step, lambda p: wsd_schedule(p, args.warmup, args.decay),
            args.optimizer,
            _card("weaver", args, f"Weaver tree adapter: d_rank {weaver.config.d_rank}, {weaver.config.num_layers} "
                  f"layer(s), pool {weaver.config.candidate_pool_size}, K {weaver.config.K}, {n_params / 1e6:.1f} M "
                  f"parameters; trained with the DFlash drafter `{args.drafter}` frozen."),
            decay_start=1 - args.decay,
        )
        train_loop(args, spec, dataset, runtime, pad_id)
    finally:
        teardown_runtime(runtime)
    return 0


# ----------------------------------------------------------------------------------------------------------------------
# CLI arguments.
# ----------------------------------------------------------------------------------------------------------------------


__all__ = [
    "BlockDrafting",
    "WeaverTeacherForcing",
    "acceptance_profile",
    "add_train_dflash_arguments",
    "add_train_weaver_arguments",
    "cosine_schedule",
    "depth_weights",
    "dflash_loss",
    "init_from_target_layers",
    "lk_loss",
    "load_training_state",
    "run_train_dflash",
    "run_train_weaver",
    "sample_anchors",
    "wsd_schedule",
]

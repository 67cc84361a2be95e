"""Pretraining the dual-path vision encoder on its own (ERNIE 5.0 report, visual understanding).

Before the encoder joins the unified backbone as a source of context groups, it learns to see on
ShapesWorld with two objectives:

- attribute prediction: per cell of the ShapesWorld 3x3 grid, the encoder's tokens pooled by their area
  overlap with the cell go through a small MLP that predicts whether the cell holds an object and the
  object's colour, shape and size (cross-entropy; the object attributes only where a cell is occupied);
- caption alignment: CLIP's symmetric contrastive loss (Radford et al. 2021) between the pooled image
  tokens and a small transformer over the caption's words (ShapesWorld's closed word vocabulary).

At the end of fit the encoder alone is written to `<default_root_dir>/vision_encoder.safetensors`, which
`DualPathEncoder(weights=...)` loads, so the unified model starts from a trained encoder.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import ClassVar

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric

from zoo.config import save_config_hyperparameters
from zoo.models.vision import DualPathEncoder
from zoo.parallel import Parallelism
from zoo.tasks.component_folders import write_component_folder
from zoo.tasks.optim import (
    LRSchedulerCallable,
    OptimizerCallable,
    build_optimizer,
    decay_groups,
    lightning_optimizers,
    refuse_replaced_arguments,
)
from zoo.tasks.sharding import ShardedStage, ShardingPlan, plain_component, with_parameters
from zoo.weights import save_weights_file
from zoo.world.scenes import (
    COLOURS,
    GRID_SIZE,
    SHAPES,
    SIZES,
    Scene,
    ShapeObject,
    caption,
    caption_vocabulary,
    score_objects,
)

warnings.filterwarnings("ignore", message="Attribute 'encoder' is an instance of `nn.Module`")

CELLS = GRID_SIZE * GRID_SIZE
IGNORE = -100
ATTRIBUTES: tuple[str, ...] = ("colour", "shape", "size")
EVAL_FIGURES: tuple[str, ...] = (
    "occupied_acc", "colour_acc", "shape_acc", "size_acc", "scene_attribute_accuracy", "scene_exact"
)  # fmt: skip
WORDS: tuple[str, ...] = caption_vocabulary()
WORD_IDS: dict[str, int] = {w: i + 1 for i, w in enumerate(WORDS)}  # 0 is padding


def scene_targets(scenes: list[Scene]) -> dict[str, Tensor]:
    """Per scene and cell (reading order): `occupied` 0/1, and `colour`/`shape`/`size` class indices
    (IGNORE where the cell is empty). Each [B, 9] long."""
    occupied = torch.zeros(len(scenes), CELLS, dtype=torch.long)
    targets = {a: torch.full((len(scenes), CELLS), IGNORE, dtype=torch.long) for a in ATTRIBUTES}
    for b, scene in enumerate(scenes):
        for o in scene.objects:
            occupied[b, o.cell_index] = 1
            targets["colour"][b, o.cell_index] = COLOURS.index(o.colour)
            targets["shape"][b, o.cell_index] = SHAPES.index(o.shape)
            targets["size"][b, o.cell_index] = SIZES.index(o.size)
    return {"occupied": occupied, **targets}


def caption_ids(texts: list[str], max_words: int) -> Tensor:
    """Word ids [B, L] (0-padded, L the longest caption) of captions in ShapesWorld's vocabulary."""
    rows = []
    for text in texts:
        words = text.split()
        unknown = [w for w in words if w not in WORD_IDS]
        if unknown:
            raise ValueError(f"caption {text!r} has words outside caption_vocabulary(): {unknown}")
        if len(words) > max_words:
            raise ValueError(f"caption of {len(words)} words exceeds max_words={max_words}: {text!r}")
        rows.append([WORD_IDS[w] for w in words])
    ids = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row)
    return ids


def cell_overlap(rows: int, cols: int) -> Tensor:
    """[9, rows*cols]: the share of each ShapesWorld cell's area covered by each token of a rows x cols grid
    (both grids span the whole image); each row sums to 1."""

    def overlap_1d(n: int) -> Tensor:
        token = torch.arange(n + 1) / n
        cell = torch.arange(GRID_SIZE + 1) / GRID_SIZE
        lo = torch.maximum(cell[:-1, None], token[None, :-1])
        hi = torch.minimum(cell[1:, None], token[None, 1:])
        return (hi - lo).clamp_min(0) * GRID_SIZE  # [GRID_SIZE, n], rows sum to 1

    return torch.einsum("ar,bc->abrc", overlap_1d(rows), overlap_1d(cols)).reshape(CELLS, rows * cols)


class CellAttributeHead(nn.Module):
    """Per ShapesWorld cell: the encoder tokens pooled by area overlap with the cell, plus a learned cell
    embedding, through a small MLP, then occupancy / colour / shape / size logits.

    Pooling by geometry rather than by learned queries keeps the head weak (it cannot do the encoder's
    work of finding objects) and lets it localise from the first step; a cross-attention head with
    learned cell queries stayed at the empty-cell prior for hundreds of steps on ShapesWorld.
    """

    def __init__(self, in_dim: int, grid: tuple[int, int], dim: int, layers: int) -> None:
        super().__init__()
        self.register_buffer("overlap", cell_overlap(*grid), persistent=False)
        self.cell_embed = nn.Parameter(torch.randn(CELLS, dim) * 0.02)
        self.inputs = nn.Sequential(nn.LayerNorm(in_dim), nn.Linear(in_dim, dim))
        blocks: list[nn.Module] = []
        for _ in range(layers):
            blocks += [nn.GELU(), nn.Linear(dim, dim)]
        self.mlp = nn.Sequential(*blocks)
        self.norm = nn.LayerNorm(dim)
        self.outputs = nn.ModuleDict(
            {"occupied": nn.Linear(dim, 2), "colour": nn.Linear(dim, len(COLOURS)),
             "shape": nn.Linear(dim, len(SHAPES)), "size": nn.Linear(dim, len(SIZES))}
        )  # fmt: skip

    def forward(self, tokens: Tensor) -> dict[str, Tensor]:
        """tokens [B, N, in_dim] (row-major grid) -> logits per attribute [B, 9, classes]."""
        cells = torch.einsum("cn,bnd->bcd", self.overlap.to(tokens.dtype), tokens)
        h = self.norm(self.mlp(self.inputs(cells) + self.cell_embed))
        return {name: out(h) for name, out in self.outputs.items()}


class CaptionEncoder(nn.Module):
    """Word embeddings + learned positions + a small pre-norm transformer, mean-pooled over words."""

    def __init__(self, dim: int, heads: int, layers: int, max_words: int, out_dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(len(WORDS) + 1, dim, padding_idx=0)
        self.positions = nn.Parameter(torch.randn(max_words, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, out_dim)

    def forward(self, ids: Tensor) -> Tensor:
        pad = ids == 0
        h = self.embed(ids) + self.positions[: ids.shape[1]]
        h = self.norm(self.encoder(h, src_key_padding_mask=pad))
        keep = (~pad).unsqueeze(-1).float()
        return self.out((h * keep).sum(1) / keep.sum(1).clamp_min(1.0))


class LearnedTemperature(nn.Module):
    """CLIP's learned logit scale, exp(log_scale) clamped at 100, as a module: FSDP2 shards modules, and a
    bare parameter of the task would stay a plain tensor beside the DTensors. One element, not a scalar:
    FSDP2 cannot shard a 0-d tensor."""

    def __init__(self, temperature: float) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.tensor([math.log(1.0 / temperature)]))

    def forward(self) -> Tensor:
        return self.log_scale.clamp(max=math.log(100.0)).exp()[0]


def _cnn_parts(cnn: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """(blocks, stem) of a timm CNN: the blocks are the children of its `layer1..4` (ResNets) or `stages`
    containers, the stem every other child (timm's feature wrapper is a `ModuleDict`, which FSDP2 cannot
    shard as one module, so its children are sharded instead)."""
    blocks, stem = [], []
    for name, child in cnn.named_children():
        if name.startswith("layer") or name == "stages":
            blocks += list(child.children())
        else:
            stem.append(child)
    return blocks, stem


class VisionEncoderPretraining(ShardedStage, L.LightningModule):
    """Trains a `DualPathEncoder` on ShapesWorld images: per-cell attributes + caption alignment.

    The datamodule gives batches {"pixels": [B, 3, H, W], "index": [B]} and `scene(index, split)`
    (zoo.datamodules.media_data.ShapesMediaDataModule with kind="image"); targets and captions are made
    here from the scenes.

    Args:
        encoder: the encoder being pretrained.
        head_dim: width of the cell-attribute head.
        head_layers: hidden layers of the cell-attribute head's MLP.
        text_dim: width of the caption encoder.
        text_heads: attention heads of the caption encoder.
        text_layers: transformer layers of the caption encoder.
        max_words: longest caption (in words) the caption encoder accepts.
        embed_dim: width of the shared image/caption embedding of the contrastive loss.
        temperature: initial softmax temperature of the contrastive loss (learned, as in CLIP).
        attribute_weight: weight of the attribute loss.
        caption_weight: weight of the contrastive caption loss (0 turns it off).
        lr: peak AdamW learning rate.
        weight_decay: decoupled weight decay of matrices.
        warmup_steps: linear warm-up, then cosine decay to `min_lr_ratio * lr`.
        min_lr_ratio: final learning rate as a fraction of `lr`.
        optimizer: builds the optimizer from the parameter groups (decayed matrices, undecayed vectors);
            None: AdamW with `lr` (zoo/tasks/optim.py).
        lr_scheduler: builds the schedule from the optimizer, stepped every step; None: warm-up-cosine with
            `warmup_steps` and `min_lr_ratio`.
        parallel: FSDP2, FP8, activation checkpointing and compile, applied in `configure_model` along
            `sharding_plan` (zoo.tasks.sharding).
    """

    # Built on `meta` under parallel.fsdp (zoo.meta_init): its construction replays bit for bit
    # (tests/test_sharding_plans.py).
    meta_init_with_fsdp: ClassVar[bool] = True

    def __init__(
        self,
        encoder: DualPathEncoder,
        head_dim: int = 128,
        head_layers: int = 2,
        text_dim: int = 96,
        text_heads: int = 4,
        text_layers: int = 2,
        max_words: int = 80,
        embed_dim: int = 128,
        temperature: float = 0.07,
        attribute_weight: float = 1.0,
        caption_weight: float = 0.5,
        lr: float = 2e-3,
        weight_decay: float = 0.05,
        warmup_steps: int = 30,
        min_lr_ratio: float = 0.1,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        parallel: Parallelism = Parallelism(),
    ) -> None:
        super().__init__()
        save_config_hyperparameters(self)  # configs, never pickled modules (zoo.config)
        self.parallel = parallel
        cls = VisionEncoderPretraining
        refuse_replaced_arguments(cls, "optimizer", optimizer, {"lr": lr})
        schedule = {"warmup_steps": warmup_steps, "min_lr_ratio": min_lr_ratio}
        refuse_replaced_arguments(cls, "lr_scheduler", lr_scheduler, schedule)
        self.optimizer_callable, self.lr_scheduler_callable = optimizer, lr_scheduler
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.encoder = encoder
        self.cell_head = CellAttributeHead(encoder.out_dim, encoder.grid, head_dim, head_layers)
        self.image_proj = nn.Sequential(nn.LayerNorm(encoder.out_dim), nn.Linear(encoder.out_dim, embed_dim))
        self.caption_encoder = CaptionEncoder(text_dim, text_heads, text_layers, max_words, embed_dim)
        self.logit_scale = LearnedTemperature(temperature)
        # Checkpoints from before the scale was a module name it `logit_scale`.
        self._register_load_state_dict_pre_hook(_rename_bare_logit_scale, with_module=True)
        self.max_words = max_words
        self.attribute_weight, self.caption_weight = attribute_weight, caption_weight
        self.lr, self.weight_decay = lr, weight_decay
        self.warmup_steps, self.min_lr_ratio = warmup_steps, min_lr_ratio
        # Means over every cell / scene of the split (a mean of per-batch means would weight cells unevenly).
        self.eval_metrics = nn.ModuleDict(
            {f"{split}__{name}": MeanMetric() for split in ("val", "test") for name in EVAL_FIGURES}
        )

    def sharding_plan(self) -> ShardingPlan:
        """Blocks: the CNN path's residual blocks, the ViT path's and the caption encoder's transformer
        blocks. Groups: the CNN's stem layers, the ViT (patch and position embeddings, final norm; run by
        `forward_features`), the patch merger, the attribute head, the image projection, the caption encoder
        and the temperature. FP8 takes the linears of the ViT blocks, the merger, the attribute head's MLP and
        the caption encoder's feed-forwards; the contrastive projections and the attribute logits stay high
        precision (`nn.MultiheadAttention`'s projections are not `nn.Linear`s FP8 converts)."""
        enc = self.encoder
        blocks, groups, methods = [], [], []
        if enc.cnn_path is not None:
            cnn_blocks, stem = _cnn_parts(enc.cnn_path)
            blocks += cnn_blocks
            groups += stem
        if enc.vit_path is not None:
            blocks += list(enc.vit_path.blocks)
            groups.append(enc.vit_path)
            methods.append((enc.vit_path, "forward_features"))
        blocks += list(self.caption_encoder.encoder.layers)
        groups += [enc.patch_merger, self.cell_head, self.image_proj, self.caption_encoder]
        groups.append(self.logit_scale)
        heads = (self.cell_head.outputs, self.image_proj, self.caption_encoder.out)
        return ShardingPlan(
            blocks=with_parameters(blocks),
            groups=with_parameters(groups),
            forward_methods=tuple(methods),
            high_precision=heads,
        )

    # ------------------------------------------------------------------ data

    def _scenes(self, index: Tensor, split: str) -> list[Scene]:
        datamodule = getattr(self._trainer, "datamodule", None)
        if datamodule is None or not hasattr(datamodule, "scene"):
            raise RuntimeError(
                "VisionEncoderPretraining needs a datamodule with scene(index, split), e.g. "
                "zoo.datamodules.media_data.ShapesMediaDataModule(kind='image')"
            )
        return [datamodule.scene(int(i), split) for i in index.tolist()]

    # ------------------------------------------------------------------ losses

    def attribute_loss(self, logits: dict[str, Tensor], targets: dict[str, Tensor]) -> Tensor:
        """Occupancy over all cells plus colour, shape and size over occupied cells, averaged."""
        losses = [F.cross_entropy(logits[k].flatten(0, 1), targets[k].flatten(), ignore_index=IGNORE)
                  for k in ("occupied", *ATTRIBUTES)]  # fmt: skip
        return torch.stack(losses).mean()

    def caption_loss(self, image: Tensor, text: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Symmetric InfoNCE; rows with the very same caption are all positives (soft targets), so two
        identical scenes in a batch are not pushed apart. Returns (loss, logits [B, B])."""
        image, text = F.normalize(image, dim=-1), F.normalize(text, dim=-1)
        logits = self.logit_scale() * image @ text.T
        same = _same_rows(ids).float()
        target = same / same.sum(1, keepdim=True)
        # `same` is symmetric and so is `target` (row i is spread over the n_i rows equal to i, n_i = n_j).
        loss = 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))
        return loss, logits

    def forward(self, pixels: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """pixels -> (encoder tokens [B, N, D], attribute logits per cell)."""
        tokens = self.encoder(pixels)
        return tokens, self.cell_head(tokens)

    def _step(self, batch: dict[str, Tensor], split: str) -> Tensor:
        pixels = batch["pixels"]
        scenes = self._scenes(batch["index"], split)
        targets = {k: v.to(pixels.device) for k, v in scene_targets(scenes).items()}
        tokens, logits = self(pixels)
        attr_loss = self.attribute_loss(logits, targets)
        loss = self.attribute_weight * attr_loss
        logs = {f"{split}/attribute_loss": attr_loss.detach()}
        if self.caption_weight > 0:
            ids = caption_ids([caption(s) for s in scenes], self.max_words).to(pixels.device)
            image = self.image_proj(tokens.mean(1))
            cap_loss, sim = self.caption_loss(image, self.caption_encoder(ids), ids)
            loss = loss + self.caption_weight * cap_loss
            logs[f"{split}/caption_loss"] = cap_loss.detach()
            logs.update({f"{split}/{k}": v for k, v in retrieval_accuracy(sim.detach(), ids).items()})
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"non-finite {split} loss ({loss.item()}) at global step {self.global_step}; "
                "training stopped before updating the weights"
            )
        logs[f"{split}/loss"] = loss.detach()
        b = pixels.shape[0]
        if split == "train":
            logs.update({f"train/{k}": v for k, v in cell_accuracies(logits, targets).items()})
            self.log_dict(logs, on_step=True, on_epoch=False, batch_size=b)
            self.log("loss", loss.detach(), prog_bar=True, logger=False, batch_size=b)
        else:
            self.log_dict(logs, on_step=False, on_epoch=True, batch_size=b, sync_dist=True)
            self._accumulate(split, logits, targets, scenes)
        return loss

    def _accumulate(
        self, split: str, logits: dict[str, Tensor], targets: dict[str, Tensor], scenes: list[Scene]
    ) -> None:
        """Exact (count-weighted) accuracies over the whole split, logged at the end of the epoch."""
        occupied = targets["occupied"] == 1
        values = {"occupied_acc": (logits["occupied"].argmax(-1) == targets["occupied"]).float().flatten()}
        for a in ATTRIBUTES:
            values[f"{a}_acc"] = (logits[a].argmax(-1) == targets[a])[occupied].float()
        scores = [score_objects(p, s.objects) for p, s in zip(predict_objects(logits), scenes, strict=True)]
        values["scene_attribute_accuracy"] = torch.tensor([s.attribute_accuracy for s in scores])
        values["scene_exact"] = torch.tensor([float(s.exact) for s in scores])
        for name, value in values.items():
            metric = self.eval_metrics[f"{split}__{name}"]
            metric.update(value.to(self.device))
            self.log(f"{split}/{name}", metric, on_epoch=True, prog_bar=name == "scene_attribute_accuracy")

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._step(batch, "val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._step(batch, "test")

    def on_fit_end(self) -> None:
        encoder = plain_component(self.encoder)  # gathers FSDP2 shards: every rank calls
        if self.trainer.is_global_zero:
            path = Path(self.trainer.default_root_dir) / "vision_encoder.safetensors"
            save_weights_file(encoder, path)
            write_component_folder(self.trainer, encoder, path)
            print(f"vision encoder weights written to {path}")

    def configure_optimizers(self):  # noqa: ANN201 (Lightning's union of return types)
        groups = decay_groups(self.parameters(), self.weight_decay)
        adamw = lambda g: torch.optim.AdamW(g, lr=self.lr)
        optimizer = build_optimizer(groups, self.optimizer_callable, adamw, type(self).__name__)
        total = lambda: self.trainer.estimated_stepping_batches  # lazily: Lightning#20550, see schedules.py
        schedule = self.lr_scheduler_callable
        return lightning_optimizers(optimizer, schedule, self.warmup_steps, total, self.min_lr_ratio)


def _rename_bare_logit_scale(module: nn.Module, state: dict, prefix: str, *args: object) -> None:
    old = prefix + "logit_scale"
    if old in state:
        state[old + ".log_scale"] = state.pop(old).reshape(1)


def _same_rows(ids: Tensor) -> Tensor:
    """[B, B] bool: rows i and j hold the same caption."""
    return (ids.unsqueeze(1) == ids.unsqueeze(0)).all(-1)


def retrieval_accuracy(sim: Tensor, ids: Tensor) -> dict[str, Tensor]:
    """In-batch top-1 retrieval, image->caption and caption->image; retrieving an identical caption
    counts as correct. Chance is about 1 / batch size."""
    same = _same_rows(ids)
    rows = torch.arange(sim.shape[0], device=sim.device)
    return {
        "retrieval_i2t": same[rows, sim.argmax(1)].float().mean(),
        "retrieval_t2i": same[sim.argmax(0), rows].float().mean(),
    }


def cell_accuracies(logits: dict[str, Tensor], targets: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per-batch accuracies: occupancy over all cells, attributes over occupied cells."""
    occupied = targets["occupied"] == 1
    out = {"occupied_acc": (logits["occupied"].argmax(-1) == targets["occupied"]).float().mean()}
    for a in ATTRIBUTES:
        out[f"{a}_acc"] = (logits[a].argmax(-1) == targets[a])[occupied].float().mean()
    return out


def predict_objects(logits: dict[str, Tensor]) -> list[tuple[ShapeObject, ...]]:
    """The objects the head sees per image: an object in each cell predicted occupied, with the most
    likely colour, shape and size (for scoring with ShapesWorld's `score_objects`)."""
    chosen = {k: v.argmax(-1).tolist() for k, v in logits.items()}
    scenes = []
    for b, occupied in enumerate(chosen["occupied"]):
        objects = []
        for cell, full in enumerate(occupied):
            if full:
                row, col = divmod(cell, GRID_SIZE)
                colour, shape = COLOURS[chosen["colour"][b][cell]], SHAPES[chosen["shape"][b][cell]]
                objects.append(ShapeObject(colour, shape, SIZES[chosen["size"][b][cell]], row, col))
        scenes.append(tuple(objects))
    return scenes

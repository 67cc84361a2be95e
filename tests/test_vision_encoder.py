"""The dual-path vision encoder and its pretraining task as a specification (issue 3 item 4).

The encoder turns [B, 3, 32, 32] images into a fixed grid of backbone-width tokens through any timm CNN
and ViT, merged per window by learned-query attention (or the MLP ablation); it loads local weights and
never downloads; the task trains it on ShapesWorld and hands the trained encoder over as safetensors.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import timm
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import save_file

from zoo.cli import ZooCLI
from zoo.config import to_config
from zoo.datamodules.media_data import ShapesMediaDataModule
from zoo.models.vision import AttentionMerger, DualPathEncoder, MlpMerger
from zoo.tasks.vision_encoder import (
    EVAL_FIGURES,
    IGNORE,
    VisionEncoderPretraining,
    caption_ids,
    cell_overlap,
    predict_objects,
    retrieval_accuracy,
    scene_targets,
)
from zoo.weights import save_weights_file
from zoo.world.scenes import COLOURS, SHAPES, SIZES, Scene, ShapeObject, ShapesWorld

VISION_CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs" / "vision").glob("*.yaml"))
SMALL = dict(out_dim=32, vit_depth=1, vit_dim=32, vit_heads=2, merger_dim=32, merger_heads=2)


def pixels(batch: int = 2, size: int = 32) -> torch.Tensor:
    return torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(0)) * 2 - 1


@pytest.fixture(scope="module")
def dual() -> DualPathEncoder:
    torch.manual_seed(0)
    return DualPathEncoder(**SMALL)


# --- shapes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "paths", [dict(), dict(vit=None), dict(cnn=None), dict(merger="mlp")], ids=["dual", "cnn", "vit", "mlp"]
)
def test_every_variant_gives_grid_tokens_of_the_backbone_width(paths):
    encoder = DualPathEncoder(**{**SMALL, **paths})
    tokens = encoder(pixels(3))
    assert encoder.grid == (4, 4)  # an 8x8 common grid merged by 2x2 windows
    assert tokens.shape == (3, 16, 32) and torch.isfinite(tokens).all()


def test_the_grid_follows_grid_size_and_window():
    encoder = DualPathEncoder(**{**SMALL, "grid_size": 6, "window": 3, "vit": None})
    assert encoder.grid == (2, 2)
    assert encoder(pixels()).shape == (2, 4, 32)


def test_gradients_reach_both_paths_and_the_merger(dual):
    dual.zero_grad()
    dual(pixels()).square().mean().backward()
    for name in ("cnn_path", "vit_path", "patch_merger"):
        grads = [p.grad for p in getattr(dual, name).parameters() if p.grad is not None]
        assert grads and any(g.abs().sum() > 0 for g in grads), f"no gradient reaches {name}"


def test_the_attention_merger_mixes_tokens_only_within_their_window():
    torch.manual_seed(0)
    merger = AttentionMerger((5, 7), dim=8, heads=2, window=2, queries=2, out_dim=6)
    cnn, vit = torch.randn(1, 4, 4, 5), torch.randn(1, 4, 4, 7)
    before = merger([cnn, vit])
    vit[0, 2] += 1.0  # change only window 2's ViT tokens
    after = merger([cnn, vit])
    changed = (after - before).abs().amax(-1)[0]
    assert changed[2] > 1e-4
    assert torch.all(changed[[0, 1, 3]] == 0)


def test_the_mlp_merger_concatenates_the_window_of_both_paths():
    merger = MlpMerger((5, 7), window=2, out_dim=6)
    assert merger.mlp[0].in_features == 4 * (5 + 7)
    assert merger([torch.randn(2, 9, 4, 5), torch.randn(2, 9, 4, 7)]).shape == (2, 9, 6)


# --- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, message",
    [
        (torch.zeros(2, 3, 32, 32, dtype=torch.uint8), "dtype torch.uint8"),
        (torch.zeros(2, 1, 32, 32), "shape [2, 1, 32, 32]"),
        (torch.zeros(2, 3, 64, 64), "shape [2, 3, 64, 64]"),
        (torch.zeros(3, 32, 32), "shape [3, 32, 32]"),
        (torch.zeros(2, 3, 5, 32, 32), "shape [2, 3, 5, 32, 32]"),
    ],
    ids=["uint8", "one-channel", "wrong-size", "unbatched", "video"],
)
def test_wrong_pixels_are_refused_with_the_expected_layout(dual, bad, message):
    with pytest.raises((TypeError, ValueError), match="expects float pixels \\[B, 3, 32, 32\\]") as err:
        dual(bad)
    assert message in str(err.value)


def test_an_encoder_without_any_path_is_refused():
    with pytest.raises(ValueError, match="at least one path"):
        DualPathEncoder(cnn=None, vit=None)


def test_an_unknown_timm_name_is_refused_by_name():
    with pytest.raises(ValueError, match="'resnet_nonexistent' is not a timm model"):
        DualPathEncoder(**{**SMALL, "cnn": "resnet_nonexistent"})


def test_a_grid_that_the_window_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="grid_size \\(8\\) must be a multiple of window \\(3\\)"):
        DualPathEncoder(**{**SMALL, "window": 3})


def test_a_missing_pretrained_file_is_refused_naming_it_and_nothing_is_downloaded(tmp_path):
    missing = tmp_path / "resnet.safetensors"
    with pytest.raises(FileNotFoundError, match="pretrained_cnn.*resnet.safetensors.*never downloaded"):
        DualPathEncoder(**{**SMALL, "pretrained_cnn": str(missing)})


# --- weights -----------------------------------------------------------------------------------------


def test_local_timm_weights_initialise_both_paths(tmp_path):
    torch.manual_seed(1)
    # A full classifier ResNet, as a user would have it on disk: the CNN path keeps its feature stages.
    resnet = timm.create_model("resnet10t", num_classes=10)
    save_file(resnet.state_dict(), str(tmp_path / "resnet.safetensors"))
    vit = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=4, depth=1, embed_dim=32, num_heads=2, num_classes=0
    )
    save_file(vit.state_dict(), str(tmp_path / "vit.safetensors"))
    encoder = DualPathEncoder(
        **SMALL,
        pretrained_cnn=str(tmp_path / "resnet.safetensors"),
        pretrained_vit=str(tmp_path / "vit.safetensors"),
    )
    assert torch.equal(encoder.cnn_path.conv1[0].weight, resnet.conv1[0].weight)
    assert torch.equal(encoder.vit_path.blocks[0].attn.qkv.weight, vit.blocks[0].attn.qkv.weight)
    assert torch.equal(encoder.vit_path.pos_embed, vit.pos_embed)
    # The saved config rebuilds the architecture without pointing at this machine's files.
    assert to_config(encoder)["init_args"]["pretrained_cnn"] is None
    assert to_config(encoder)["init_args"]["pretrained_vit"] is None


def test_saved_encoder_weights_load_back_to_the_same_outputs(dual, tmp_path):
    path = save_weights_file(dual, tmp_path / "encoder.safetensors")
    torch.manual_seed(123)  # a different random init, overwritten by the file
    loaded = DualPathEncoder(**SMALL, weights=str(path)).eval()
    with torch.no_grad():
        assert torch.equal(loaded(pixels()), dual.eval()(pixels()))
    assert to_config(loaded)["init_args"]["weights"] is None


def test_weights_of_another_architecture_are_refused_naming_the_file(dual, tmp_path):
    path = save_weights_file(dual, tmp_path / "encoder.safetensors")
    with pytest.raises(ValueError, match="DualPathEncoder weights: cannot load .*encoder.safetensors"):
        DualPathEncoder(**{**SMALL, "merger": "mlp"}, weights=str(path))


def test_weights_path_that_does_not_exist_is_refused(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="nowhere.safetensors does not exist"):
        DualPathEncoder(**SMALL, weights=str(tmp_path / "nowhere.safetensors"))


# --- pretraining task --------------------------------------------------------------------------------


def test_scene_targets_mark_each_object_in_its_cell_and_ignore_empty_cells():
    scene = Scene(
        (ShapeObject("red", "circle", "small", 0, 0), ShapeObject("blue", "cross", "large", 2, 1)), 0, "train"
    )
    targets = scene_targets([scene])
    assert targets["occupied"][0].tolist() == [1, 0, 0, 0, 0, 0, 0, 1, 0]
    assert targets["colour"][0, 0] == COLOURS.index("red") and targets["colour"][0, 7] == COLOURS.index(
        "blue"
    )
    assert targets["shape"][0, 7] == SHAPES.index("cross") and targets["size"][0, 7] == SIZES.index("large")
    assert (targets["colour"][0, [1, 2, 3, 4, 5, 6, 8]] == IGNORE).all()


def test_cells_pool_the_tokens_they_overlap_by_area():
    assert torch.allclose(cell_overlap(3, 3), torch.eye(9))
    overlap = cell_overlap(4, 4)  # a 4x4 token grid under the 3x3 cells
    assert torch.allclose(overlap.sum(1), torch.ones(9))
    # The top-left cell (side 1/3) holds 3/4 of its side in token column 0 and 1/4 in column 1; rows alike.
    expected = torch.zeros(16)
    expected[[0, 1, 4, 5]] = torch.tensor([9, 3, 3, 1]) / 16
    assert torch.allclose(overlap[0], expected)


def test_caption_ids_refuse_words_outside_the_shapesworld_vocabulary_and_overlong_captions():
    ids = caption_ids(["a small red circle at the top left", "a large blue cross in the center"], 80)
    assert ids.shape == (2, 8) and (ids[0] > 0).all()
    assert (ids[1, :7] > 0).all() and ids[1, 7] == 0  # 7 words, padded with 0
    with pytest.raises(ValueError, match="outside caption_vocabulary\\(\\): \\['dog'\\]"):
        caption_ids(["a small red dog at the top"], 80)
    with pytest.raises(ValueError, match="exceeds max_words=4"):
        caption_ids(["a small red circle at the top"], 4)


def test_predicted_objects_read_back_perfect_logits_as_the_scene():
    scene = ShapesWorld(seed=0).scene(5, "val")
    targets = scene_targets([scene])
    logits = {k: F.one_hot(v.clamp_min(0), n).float() for k, v, n in (
        ("occupied", targets["occupied"], 2), ("colour", targets["colour"], len(COLOURS)),
        ("shape", targets["shape"], len(SHAPES)), ("size", targets["size"], len(SIZES)))}  # fmt: skip
    assert predict_objects(logits)[0] == scene.objects


def test_retrieval_counts_an_identical_caption_as_a_hit():
    ids = torch.tensor([[1, 2], [1, 2], [3, 4]])
    sim = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    acc = retrieval_accuracy(sim, ids)
    assert acc["retrieval_i2t"] == pytest.approx(2 / 3)  # row 0 picks row 1's identical caption
    assert acc["retrieval_t2i"] == pytest.approx(2 / 3)  # caption 1 is picked by no image of its own


def make_task(**encoder) -> VisionEncoderPretraining:
    torch.manual_seed(0)
    return VisionEncoderPretraining(
        DualPathEncoder(**{**SMALL, **encoder}), head_dim=32, head_layers=1, text_dim=32,
        text_heads=2, text_layers=1, embed_dim=32, lr=3e-3, warmup_steps=2,
    )  # fmt: skip


def test_pretraining_logs_every_figure_and_hands_over_the_trained_encoder(tmp_path):
    task = make_task()
    data = ShapesMediaDataModule(kind="image", train_size=64, val_size=32, batch_size=16)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=8, default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, val_check_interval=8,
        check_val_every_n_epoch=None, callbacks=[checkpoint],
    )  # fmt: skip
    trainer.fit(task, datamodule=data)
    logged = trainer.logged_metrics
    for split in ("train", "val"):
        for name in ("attribute_loss", "caption_loss", "retrieval_i2t", "retrieval_t2i", *EVAL_FIGURES[:4]):
            assert f"{split}/{name}" in logged, f"{split}/{name} not logged: {sorted(logged)}"
    for name in EVAL_FIGURES:
        assert 0.0 <= float(logged[f"val/{name}"]) <= 1.0
    # Accuracies are over all 32 val scenes at once, not a mean of batch means.
    assert task.eval_metrics["val__colour_acc"].update_count == 0  # reset after being logged
    # The encoder alone, loadable into a fresh DualPathEncoder with the same arguments.
    weights = tmp_path / "vision_encoder.safetensors"
    assert weights.is_file()
    loaded = DualPathEncoder(**SMALL, weights=str(weights)).eval()
    with torch.no_grad():
        assert torch.equal(loaded(pixels()), task.encoder.eval()(pixels()))
    # A checkpoint holds configs, not pickled objects, and rebuilds the task.
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert ckpt["hyper_parameters"]["encoder"]["class_path"] == "zoo.models.vision.DualPathEncoder"
    restored = VisionEncoderPretraining.load_from_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    assert torch.equal(restored.encoder.state_dict()["vit_path.pos_embed"], task.encoder.vit_path.pos_embed)


def test_attribute_training_lowers_the_loss_on_a_fixed_batch():
    task = make_task(vit=None)
    data = ShapesMediaDataModule(kind="image", train_size=16, val_size=16, batch_size=16)
    batch = next(iter(data.train_dataloader()))
    targets = scene_targets([data.scene(int(i)) for i in batch["index"]])
    optimizer = torch.optim.AdamW(task.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss = task.attribute_loss(task(batch["pixels"])[1], targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0]


def test_pretraining_without_a_scene_aware_datamodule_says_what_it_needs():
    task = make_task(vit=None)
    with pytest.raises(RuntimeError, match="needs a datamodule with scene\\(index, split\\)"):
        task._scenes(torch.tensor([0]), "train")


# --- configs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", VISION_CONFIGS, ids=lambda p: p.stem)
def test_every_vision_config_builds_the_task_and_the_image_data(path, tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["zoo"])
    monkeypatch.chdir(tmp_path)
    cli = ZooCLI(args=["--config", str(path), f"--trainer.default_root_dir={tmp_path}"], run=False)
    assert isinstance(cli.model, VisionEncoderPretraining)
    assert isinstance(cli.datamodule, ShapesMediaDataModule) and cli.datamodule.kind == "image"
    encoder = cli.model.encoder
    assert encoder.image_size == cli.datamodule.size and encoder.out_dim == 128
    paths = (encoder.cnn_path is not None, encoder.vit_path is not None)
    expected = {"encoder_cnn_only": (True, False), "encoder_vit_only": (False, True)}.get(
        path.stem, (True, True)
    )
    assert paths == expected
    merger = "mlp" if path.stem == "encoder_mlp_merger" else "attention"
    assert to_config(encoder)["init_args"]["merger"] == merger

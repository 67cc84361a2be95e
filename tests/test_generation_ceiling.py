"""The tokenizer's ceiling of a generation task: the verifier's score of the scenes' true media through the
frozen tokenizer (encode, decode). The model only draws codes, so no generation can be scored above it; the
demo's 600-step tokenizer capped caption to image at about 0.55 attributes (docs/results.md, issue 19)."""

from __future__ import annotations

import torch

from zoo.datamodules.sequence import MediaLayout
from zoo.datamodules.shapes_multimodal import ShapesMultimodalDataModule
from zoo.models.backbone import UnifiedTransformer
from zoo.models.unified import UnifiedModel
from zoo.tasks.multimodal_eval import evaluate, write_gallery
from zoo.tokenizers.visual import VisualTokenizer
from zoo.tokenizers.vocab import UnifiedVocab
from zoo.world.render import render_image, to_tensor, verify_image


def tiny_image_model() -> tuple[UnifiedModel, ShapesMultimodalDataModule]:
    torch.manual_seed(0)
    visual = VisualTokenizer()
    vocab = UnifiedVocab(text_size=320, visual_size=visual.codebook_size)
    backbone = UnifiedTransformer(
        dim=32, n_layers=1, n_heads=2, n_kv_heads=1, n_experts=2, expert_hidden=16, top_k=1, max_seq_len=160
    )
    model = UnifiedModel(backbone, vocab, mtp_depth=0, visual_tokenizer=visual).eval()
    data = ShapesMultimodalDataModule(
        vocab=vocab, layout=MediaLayout.of(model), caption_weight=0.0, text_to_image_weight=1.0,
        image_to_text_weight=0.0, max_objects=1, train_size=64, val_size=16, tokenizer_size=300, seq_len=160,
    )  # fmt: skip
    data.setup("validate")
    return model, data


def test_the_ceiling_scores_the_scenes_own_reconstructions_whatever_the_model_draws(tmp_path):
    model, data = tiny_image_model()
    first = evaluate(model, data, 2, tasks=["text_to_image"], seed=1)
    second = evaluate(model, data, 2, tasks=["text_to_image"], seed=2, temperature=2.0)
    for key in ("text_to_image/ceiling_exact", "text_to_image/ceiling_attribute_accuracy"):
        assert first.metrics[key] == second.metrics[key], key  # the scenes decide it, not the sampling
    scenes = data.world.scenes("val", 2)
    tokenizer = model.nfsp.tokenizer
    pixels = torch.stack([to_tensor(render_image(s, 32)) for s in scenes])
    decoded = tokenizer.decode(tokenizer.encode(pixels))
    by_hand = [verify_image(im, scene).attribute_accuracy for im, scene in zip(decoded, scenes, strict=True)]
    assert abs(first.metrics["text_to_image/ceiling_attribute_accuracy"] - sum(by_hand) / 2) < 1e-9
    # The rendered scenes themselves read back perfectly: the ceiling below 1 is the tokenizer's doing.
    assert all(verify_image(p, s).exact for p, s in zip(pixels, scenes, strict=True))
    page = write_gallery(first, tmp_path).read_text()
    assert "tokenizer's ceiling" in page
    row = next(line for line in page.splitlines() if line.startswith("| text_to_image |"))
    m = first.metrics
    ceiling = f"{m['text_to_image/ceiling_exact']:.2f} / {m['text_to_image/ceiling_attribute_accuracy']:.2f}"
    cells = [cell.strip() for cell in row.strip(" |").split("|")]
    assert cells[6] == ceiling  # the column after the baselines

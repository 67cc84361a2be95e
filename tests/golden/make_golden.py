"""Regenerates the golden outputs of tests/test_golden.py. Run only after a deliberate numeric change:

.venv/bin/python tests/golden/make_golden.py
"""

from pathlib import Path

import torch
from safetensors.torch import save_file

from zoo.datamodules.sequence import SequenceBuilder, TextSegment
from zoo.registry import create_model

GOLDEN = Path(__file__).parent / "tiny_outputs.safetensors"
SHAPE = dict(
    dim=32,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    n_dense_layers=1,
    n_experts=8,
    expert_hidden=16,
    top_k=2,
    max_seq_len=64,
)


def golden_model():
    torch.manual_seed(1234)
    return create_model("tiny", **SHAPE).eval()


def golden_batch(vocab):
    docs = [
        [TextSegment([1, 20, 21, 22, 23, 2])],
        [TextSegment([1, 40, 41, 2])],
        [TextSegment([1, 50, 51, 52, 2])],
    ]
    return SequenceBuilder(vocab, 12).collate(docs)


def golden_outputs() -> dict[str, torch.Tensor]:
    model = golden_model()
    batch = golden_batch(model.vocab)
    with torch.no_grad():
        out = model(batch)
        logits = model.text_head.logits(out.backbone.hidden)
    return {
        "hidden": out.backbone.hidden,
        "logits": logits,
        "loss": out.loss.reshape(1),
        "ntp_loss": out.heads["text"].metrics["text/ntp_loss"].reshape(1),
        "mtp1_loss": out.heads["text"].metrics["text/mtp1_loss"].reshape(1),
        "router_indices_layer1": out.backbone.router[0][1].indices,
        "router_weights_layer1": out.backbone.router[0][1].weights,
    }


if __name__ == "__main__":
    save_file({k: v.contiguous() for k, v in golden_outputs().items()}, str(GOLDEN))
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")

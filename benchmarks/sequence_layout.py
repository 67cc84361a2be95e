"""How long laying out a batch takes next to the forward pass that reads it (`SequenceBuilder.layout_rows`).

RL lays out every rollout batch several times a step (the engine's prefill, l_old with and without
router replay, l with gradient), so the layout must cost little next to a forward. Rows are image-caption
rollouts as `zoo.rl.prompts` builds them: `<bos> <boi>` 85 visual codes `<eoi>` then a 16-token caption,
and text rows of the same length. The baseline, measured in the same run, is a no-grad forward of the
demo-sized unified model (dim 128, 4 layers, 16 experts) on the laid-out batch.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sequence_layout.py

Prints one JSON line: median seconds of each layout and of the forward, and `layout_over_forward` per kind.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, emit, log, machine_info, time_interleaved  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128, help="rows per batch (an RL step's G x queries)")
    add_common_args(parser, repeats=5)
    args = parser.parse_args()
    info = machine_info(args.threads)
    torch.manual_seed(args.seed)
    from zoo.datamodules.sequence import MediaLayout, SequenceBuilder, TextSegment, VisualSegment
    from zoo.models.backbone import UnifiedTransformer
    from zoo.models.unified import UnifiedModel
    from zoo.tokenizers.visual import VisualTokenizer
    from zoo.tokenizers.vocab import UnifiedVocab

    visual = VisualTokenizer()
    vocab = UnifiedVocab(text_size=512, visual_size=visual.codebook_size, audio_size=256, audio_levels=4)
    backbone = UnifiedTransformer(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, n_dense_layers=1, n_experts=16, n_shared_experts=1,
        expert_hidden=64, top_k=4, max_seq_len=512,
    )  # fmt: skip
    model = UnifiedModel(backbone, vocab, visual_tokenizer=visual).eval()
    builder = SequenceBuilder(vocab, 512, layout=MediaLayout.of(model))
    caption = [vocab.text_offset + i for i in range(16)]
    n_codes = builder.layout.tokens_per_frame
    image_rows = [
        [[TextSegment([vocab.bos_id], False),
          VisualSegment(codes=torch.randint(0, 512, (n_codes,)), predict=False),
          TextSegment(caption, False)]]
        for _ in range(args.rows)
    ]  # fmt: skip
    length = builder.length(image_rows[0][0])
    text_rows = [[[TextSegment([vocab.bos_id] + [vocab.text_offset + 1] * (length - 1), False)]]] * args.rows
    image_batch = builder.layout_rows(image_rows, length, left_pad=True)

    def forward() -> None:
        with torch.no_grad():
            model(image_batch)

    variants = {
        "layout_image_rows": lambda: builder.layout_rows(image_rows, length, left_pad=True),
        "layout_text_rows": lambda: builder.layout_rows(text_rows, length, left_pad=True),
        "forward": forward,
    }
    log(f"{args.rows} rows of {length} positions")
    medians, _, spread = time_interleaved(variants, args.warmup, args.repeats)
    emit(
        {
            "benchmark": "sequence_layout",
            "rows": args.rows,
            "positions_per_row": length,
            **{f"{name}_s": round(value, 4) for name, value in medians.items()},
            "image_layout_over_forward": round(medians["layout_image_rows"] / medians["forward"], 3),
            "text_layout_over_forward": round(medians["layout_text_rows"] / medians["forward"], 3),
            "timing_spread": spread,
            "machine": info,
        }
    )


if __name__ == "__main__":
    main()

"""Benchmark of NFSP image generation against token-by-token raster decoding of the same code map.

Next-scale prediction generates an image of K scales in K backbone steps (all s*s positions of a scale
at once); raster decoding of the same multi-scale code map needs one step per code (sum of s^2 steps,
85 for scales 1, 2, 4, 8). Both run the same tiny unified model with the KV cache, the same batch and
the same sampling; only the number of positions per step differs. That is the reason ERNIE 5.0 (and
VAR before it) predicts scales rather than rasters. `--checkpoint` evaluates a trained unified model
(a Lightning checkpoint with a visual tokenizer); by default a tiny model with an untrained tokenizer is
built (speed does not depend on the weights).

    .venv/bin/python benchmarks/nfsp.py [--batch 8 --repeats 3 --checkpoint runs/.../last.ckpt]

Key `nfsp_vs_raster_speedup` (target >= 3). Progress on stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, emit, log, machine_info, time_interleaved  # noqa: E402

from zoo.hub import load_lightning_checkpoint  # noqa: E402
from zoo.models.backbone import UnifiedTransformer  # noqa: E402
from zoo.models.media_generation import generate_visual  # noqa: E402
from zoo.models.unified import UnifiedModel  # noqa: E402
from zoo.tokenizers.visual import VisualTokenizer  # noqa: E402
from zoo.tokenizers.vocab import UnifiedVocab  # noqa: E402

SPEEDUP_TARGET = 3.0


def tiny_visual_model() -> UnifiedModel:
    """The quickstart's tiny backbone with the default visual tokenizer (scales 1, 2, 4, 8)."""
    tokenizer = VisualTokenizer()
    vocab = UnifiedVocab(text_size=512, visual_size=tokenizer.codebook_size, audio_size=256, audio_levels=4)
    backbone = UnifiedTransformer(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, n_dense_layers=1, n_experts=16, n_shared_experts=1,
        expert_hidden=64, top_k=4, max_seq_len=512,
    )
    return UnifiedModel(backbone, vocab, mtp_depth=1, visual_tokenizer=tokenizer)


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    add_common_args(parser, repeats=3)
    parser.add_argument("--batch", type=int, default=8, help="images generated per call")
    parser.add_argument("--cfg-scale", type=float, default=2.0, help="guidance (doubles the rows when > 0)")
    parser.add_argument("--checkpoint", help="checkpoint of a unified model with a visual tokenizer")
    args = parser.parse_args()
    info = machine_info(args.threads)
    torch.manual_seed(args.seed)
    model = load_lightning_checkpoint(args.checkpoint)[0] if args.checkpoint else tiny_visual_model()
    model.eval()
    if model.nfsp is None:
        raise SystemExit("the model has no visual tokenizer: NFSP needs one")
    vocab = model.vocab
    prompt = [vocab.bos_id, *range(vocab.text_offset, vocab.text_offset + 12), vocab.special("<boi>")]
    prompts = [prompt] * args.batch

    def run(raster: bool):  # noqa: ANN202
        generator = torch.Generator().manual_seed(args.seed)
        return generate_visual(model, prompts, 1, args.cfg_scale, 1.0, 8, None, generator, raster=raster)

    log(f"generating {args.batch} images per call, scales {model.nfsp.scales}, cfg {args.cfg_scale}")
    medians, results, spread = time_interleaved(
        {"nfsp": lambda: run(False), "raster": lambda: run(True)}, args.warmup, args.repeats
    )
    steps_nfsp = len(model.nfsp.scales)
    steps_raster = model.nfsp.tokens_per_frame
    speedup = medians["raster"] / medians["nfsp"]
    emit({
        "benchmark": "nfsp",
        **info,
        "batch": args.batch,
        "cfg_scale": args.cfg_scale,
        "scales": list(model.nfsp.scales),
        "backbone_steps_nfsp": steps_nfsp,
        "backbone_steps_raster": steps_raster,
        "nfsp_images_per_s": round(args.batch / medians["nfsp"], 2),
        "raster_images_per_s": round(args.batch / medians["raster"], 2),
        "nfsp_vs_raster_speedup": round(speedup, 2),
        "target": SPEEDUP_TARGET,
        "meets_target": speedup >= SPEEDUP_TARGET,
        "timing_spread": spread,
        "checkpoint": args.checkpoint,
    })


if __name__ == "__main__":
    main()

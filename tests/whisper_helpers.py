"""A tiny randomly initialised Whisper model folder, written the way `save_pretrained` writes real ones, for
tests/test_whisper_teacher.py and tests/test_configs.py (weights cannot be downloaded here)."""

from __future__ import annotations

from pathlib import Path


def save_tiny_whisper(folder: Path, seed: int = 0, encoder_layers: int = 2) -> Path:
    """A `WhisperModel` of d_model 32 (~90k parameters) and its feature extractor, saved in `folder`.

    The special token ids must lie inside the tiny vocabulary: with Whisper's defaults (50256...)
    `transformers` 5 refuses to build the decoder's embedding.
    """
    import torch
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperModel

    config = WhisperConfig(
        d_model=32,
        encoder_layers=encoder_layers,
        encoder_attention_heads=2,
        decoder_layers=1,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        vocab_size=64,
        max_source_positions=1500,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=3,
        suppress_tokens=[],
        begin_suppress_tokens=[],
    )
    torch.manual_seed(seed)
    WhisperModel(config).save_pretrained(folder)
    WhisperFeatureExtractor().save_pretrained(folder)
    return Path(folder)

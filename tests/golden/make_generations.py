"""What seeded tiny models generate, pinned for tests/test_generation_golden.py (issue 15: the decode path is
rebuilt behaviour-preserving, so every greedy and seeded sampled output must stay what it was).

Covers every decode loop: cached text (batched, left-padded, elastic, sampled with top-k / top-p), MTP
speculative decoding, NFSP images (greedy, guided, sampled) and video, NCP speech, captions after media, and
the RL engine (continuous batching with a sync mid-flight, image / speech / caption rollouts) with its
log-probs. Regenerate only after a deliberate change of what the models compute:

.venv/bin/python tests/golden/make_generations.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from zoo.datamodules.sequence import ContextSegment, TextSegment, VisualSegment
from zoo.models.backbone import UnifiedTransformer
from zoo.models.elastic import ElasticConfig
from zoo.models.generation import speculative_generate
from zoo.models.media_generation import generate_audio, generate_text_after, generate_visual
from zoo.models.nfsp import flatten_scales
from zoo.models.unified import UnifiedModel
from zoo.registry import create_model
from zoo.rl.prompts import PromptLayout
from zoo.rl.rollout import InferenceEngine
from zoo.tokenizers.audio import AudioCodec
from zoo.tokenizers.visual import VisualTokenizer
from zoo.tokenizers.vocab import UnifiedVocab

GENERATIONS = Path(__file__).parent / "generations.json"
TEXT_PROMPTS = [[1, 20, 21, 22], [1, 30], [1, 40, 41, 42, 43, 44]]


def text_model() -> UnifiedModel:
    torch.manual_seed(1234)
    shape = dict(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, n_experts=8, expert_hidden=16, top_k=2)
    return create_model("tiny", **shape, max_seq_len=96).eval()


def media_model(temporal: bool = False) -> UnifiedModel:
    torch.manual_seed(0)
    tokenizer = VisualTokenizer(temporal=True, temporal_stride=2) if temporal else VisualTokenizer()
    vocab = UnifiedVocab(text_size=64, visual_size=tokenizer.codebook_size, audio_size=256, audio_levels=4)
    backbone = UnifiedTransformer(
        dim=32, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4, expert_hidden=16, top_k=2, max_seq_len=400
    )
    if temporal:
        return UnifiedModel(backbone, vocab, mtp_depth=0, visual_tokenizer=tokenizer).eval()
    from zoo.models.vision import DualPathEncoder

    encoder = DualPathEncoder(out_dim=48)
    media = dict(visual_tokenizer=tokenizer, audio_codec=AudioCodec(), vision_encoder=encoder)
    return UnifiedModel(backbone, vocab, mtp_depth=0, **media).eval()


def image(seed: int) -> torch.Tensor:
    return torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rounded(values: torch.Tensor) -> list[float]:
    return [round(float(v), 6) for v in values]


def text_generations() -> dict[str, object]:
    model = text_model()
    out: dict[str, object] = {}
    out["greedy"] = model.generate(TEXT_PROMPTS, 16, temperature=0.0, stop_ids=())
    out["greedy_stop"] = model.generate(TEXT_PROMPTS, 16, temperature=0.0)
    out["elastic"] = model.generate(
        TEXT_PROMPTS, 12, temperature=0.0, stop_ids=(), elastic=ElasticConfig(layers=(0, 2), top_k=1)
    )
    out["sampled_top_k"] = model.generate(TEXT_PROMPTS, 16, 1.0, top_k=20, stop_ids=(), generator=seeded(7))
    out["sampled_top_p"] = model.generate(TEXT_PROMPTS, 16, 0.8, top_p=0.9, stop_ids=(), generator=seeded(8))
    tokens, acceptance = speculative_generate(model, TEXT_PROMPTS[0], 20, stop_ids=())
    out["speculative"], out["speculative_acceptance"] = tokens, round(acceptance, 6)
    model.decode_text_with(40)
    out["decodable_40"] = model.generate(TEXT_PROMPTS, 12, 1.5, stop_ids=(), generator=seeded(9))
    return out


def engine_text_generations() -> dict[str, object]:
    model = text_model()
    out: dict[str, object] = {}
    engine = InferenceEngine(model, max_new_tokens=10, stop_ids=(), max_batch=2, seed=3)
    rollouts = engine.start(TEXT_PROMPTS + TEXT_PROMPTS[:1], [None] * 4, max_new_tokens=[4, 10, 7, 9])
    engine.step(3)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    engine.sync(model, version=1)
    while engine.pending:
        engine.step(4)
    out["continuous_sync_ids"] = [r.response_ids for r in rollouts]
    out["continuous_sync_versions"] = [r.versions for r in rollouts]
    out["continuous_sync_logprobs"] = [rounded(r.inf_logprobs) for r in rollouts]
    greedy = InferenceEngine(model, precision="bfloat16", max_new_tokens=8, temperature=0.0, stop_ids=())
    out["bf16_greedy_ids"] = [r.response_ids for r in greedy.generate(TEXT_PROMPTS, [None] * 3)]
    return out


def media_generations() -> dict[str, object]:
    model = media_model()
    vocab = model.vocab
    out: dict[str, object] = {}
    draw = [vocab.bos_id, vocab.text_offset + 3, vocab.text_offset + 9, vocab.special("<boi>")]
    draw2 = [vocab.bos_id, vocab.text_offset + 5, vocab.special("<boi>")]
    for name, kwargs in (
        ("image_greedy", dict(temperature=0.0)),
        ("image_guided", dict(cfg_scale=3.0, temperature=0.0)),
        ("image_sampled", dict(temperature=1.0, top_k=50, generator=seeded(11))),
        ("image_raster", dict(temperature=0.0, raster=True)),
    ):
        out[name] = flatten_scales(generate_visual(model, [draw, draw2], **kwargs)).tolist()
    say = [vocab.bos_id, vocab.text_offset + 5, vocab.special("<boa>")]
    say2 = [vocab.bos_id, vocab.text_offset + 7, vocab.text_offset + 8, vocab.special("<boa>")]
    out["audio_greedy"] = [c.tolist() for c in generate_audio(model, [say, say2], 6, temperature=0.0)]
    sampled = generate_audio(model, [say, say2], 6, temperature=1.0, top_p=0.95, generator=seeded(12))
    out["audio_sampled"] = [c.tolist() for c in sampled]
    text = TextSegment([vocab.bos_id, vocab.text_offset + 2])
    documents = [[text, ContextSegment(image(3))], [text, VisualSegment(image(4), predict=False)]]
    layout = PromptLayout(model)
    batch = layout.builder.collate_prompts(documents)
    out["caption_greedy"] = generate_text_after(model, batch, 6, temperature=0.0, stop_ids=(-1,))
    out["caption_sampled"] = generate_text_after(model, batch, 6, 1.0, top_k=30, generator=seeded(13))

    engine = InferenceEngine(model, max_new_tokens=5, seed=4, max_audio_frames=5)
    prompts = [draw, say, [text, VisualSegment(image(5), predict=False)], say2, [vocab.bos_id, 20]]
    rollouts = engine.generate(prompts, [None] * len(prompts))
    out["engine_media_ids"] = [r.response_ids for r in rollouts]
    out["engine_media_logprobs"] = [rounded(r.inf_logprobs) for r in rollouts]
    out["engine_media_routing_rows"] = [int(next(iter(r.routing.values())).shape[0]) for r in rollouts]
    return out


def video_generations() -> dict[str, object]:
    model = media_model(temporal=True)
    vocab = model.vocab
    prompt = [vocab.bos_id, vocab.text_offset + 2, vocab.special("<bov>")]
    codes = generate_visual(model, [prompt], frames=3, temperature=0.0)
    return {"video_greedy": flatten_scales(codes).tolist()}


def generations() -> dict[str, object]:
    with torch.no_grad():
        return {
            "text": text_generations(),
            "engine_text": engine_text_generations(),
            "media": media_generations(),
            "video": video_generations(),
        }


if __name__ == "__main__":
    GENERATIONS.write_text(json.dumps(generations()) + "\n")
    print(f"wrote {GENERATIONS} ({GENERATIONS.stat().st_size} bytes)")

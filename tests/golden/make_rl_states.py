"""Checkpoint states of RL rollouts as the code before issue 15 wrote them, for tests/test_rl_records.py:
weights-only RL checkpoints written before the RL package was rebuilt must keep loading. Written once;
rerun only to add a new case (never to "fix" an old one):

.venv/bin/python tests/golden/make_rl_states.py
"""

from __future__ import annotations

from pathlib import Path

import torch
from make_generations import image, media_model, text_model  # noqa: E402 (run from tests/golden)

from zoo.datamodules.sequence import TextSegment, VisualSegment
from zoo.rl.records import Query
from zoo.rl.rollout import InferenceEngine
from zoo.rl.schedulers import URBScheduler

STATES = Path(__file__).parent / "rl_states.pt"


class Source:
    def __init__(self) -> None:
        self.drawn = 0

    def next_queries(self, n: int) -> list[Query]:
        self.drawn += n
        drawn = range(self.drawn - n, self.drawn)
        return [Query(str(k), f"q{k}", str(k), str(k), "add", 1 + k % 2) for k in drawn]

    def encode_prompt(self, query: Query) -> list[int]:
        return [1, 20 + int(query.id), 21]

    def response_budget(self, query: Query, j: int) -> int:
        return 2 + 3 * int(query.id) + j  # later queries are longer: the next data group is mid-flight


def states() -> dict:
    model = text_model()
    engine = InferenceEngine(model, max_new_tokens=30, stop_ids=(), seed=0)
    scheduler, source = URBScheduler(n_groups=2), Source()
    for version in range(2):
        scheduler.next_batch(engine, source, 2, 2, version)
        engine.sync(model, version + 1)
    scheduled = scheduler.checkpoint_state(engine)  # D_2 in flight: partial responses, queued in the engine
    media = media_model()
    engine = InferenceEngine(media, max_new_tokens=6, stop_ids=(), seed=1)
    prompt = [TextSegment([media.vocab.bos_id]), VisualSegment(image(2), predict=False)]
    query = Query("image/0", "", "a red square", "a red square", "image_caption")
    engine.start([prompt, [media.vocab.bos_id, 30]], [query, query])
    engine.step(2)
    return {
        "scheduler": scheduled,
        "media_rollouts": [r.to_state() for r in engine.interrupt()],
    }


if __name__ == "__main__":
    with torch.no_grad():
        torch.save(states(), STATES)
    print(f"wrote {STATES} ({STATES.stat().st_size} bytes)")

"""A reward from the model's own reading: RL for generated media without a verifier.

A caption-to-media rollout (an image, a video, speech) is rewarded by how likely a frozen copy of the starting
policy reads it back as the caption it was asked for: the reading `zoo.inference.best_of` ranks candidates
with, `<bos> medium caption <eos>` laid out as the understanding documents of pretraining, the caption and
`<eos>` teacher-forced. The reward is their per-token probability, `exp` of the mean log-prob, in (0, 1]: a
query's responses share the caption, so within a group it orders them as the summed log-prob does, which
is all GRPO's group-normalised advantages use.

No verifier and no ground truth take part, which is what data without a verifier allows (real image-caption
pairs): where the model reads better than it draws, GRPO learns which of a query's G draws read best,
the best of N taken into the policy. Validation still scores held-out queries with the verifiers, so the
run measures what the reading taught. The reader is a frozen copy (`RLTask` makes it before any update,
as it makes a KL term's reference): trained along with the drawing, the same weights could learn to read
their own draws as whatever was asked.
"""

from __future__ import annotations

import math

from zoo.datamodules.sequence import Segment, SequenceBuilder
from zoo.inference.best_of import reading, score_documents
from zoo.models.unified import UnifiedModel
from zoo.rl.verifiers import VerifierResult

DOCUMENTS_PER_CALL = 64  # reading documents scored in one forward pass


class ReadingReward:
    """Rewards of media rollouts by `reader`'s reading: `submit` each (its caption ids and the response as an
    input segment, None when nothing was drawn: reward 0), `collect` a step's in forward passes of
    `DOCUMENTS_PER_CALL` documents.

    Args:
        reader: the frozen model that reads (a copy of the starting policy).
        builder: lays the reading documents out (the policy's `PromptLayout` builder).
    """

    counts: dict[str, int]

    def __init__(self, reader: UnifiedModel, builder: SequenceBuilder) -> None:
        self.reader, self.builder = reader, builder
        self.counts = {"read": 0, "unreadable": 0}
        self._pending: dict[int, tuple[list[int], Segment | None]] = {}
        self._next = 0

    def submit(self, caption: list[int], medium: Segment | None) -> int:
        ticket, self._next = self._next, self._next + 1
        self._pending[ticket] = (list(caption), medium)
        return ticket

    def collect(self, tickets: list[int]) -> dict[int, VerifierResult]:
        vocab = self.reader.vocab
        results = {t: VerifierResult(0.0) for t in tickets if self._pending[t][1] is None}
        readable = [t for t in tickets if t not in results]
        self.counts["unreadable"] += len(results)
        for start in range(0, len(readable), DOCUMENTS_PER_CALL):
            chunk = readable[start : start + DOCUMENTS_PER_CALL]
            pairs = [self._pending[t] for t in chunk]
            documents = [reading(caption, medium, vocab.bos_id, vocab.eos_id) for caption, medium in pairs]
            sums = score_documents(self.reader, self.builder, documents).tolist()
            for ticket, (caption, _), total in zip(chunk, pairs, sums, strict=True):
                results[ticket] = VerifierResult(math.exp(total / (len(caption) + 1)))  # + 1: the <eos>
        self.counts["read"] += len(readable)
        for t in tickets:
            del self._pending[t]
        return results

"""Supervised fine-tuning (SFT, issue 18 item 1): the unified model learns to answer conversations.

`SupervisedFineTuning` is a thin subclass of `UnifiedPretraining`: the same step, losses, elastic draws,
parallelism and checkpoints. What makes it SFT is the data: `ConversationDataModule` lays every conversation
out in the chat format with targets only on the assistant's turns (`chat_document(answers_predicted=True)`),
so the text, NFSP and NCP losses the step already computes are the losses of what the assistant says, writes,
draws or speaks, and nothing of the user's turns. A subclass rather than a mode of pretraining because it
refuses what would silently train something else (a vocabulary without role tokens, data that is not
conversations) and logs the share of positions that carry loss, which pretraining has no use for.

Validation also answers held-out conversations of every verifiable source (`ConversationSource.verifiable`:
`ArithmeticInstructions`) greedily, prompted in the chat format as `zoo chat` prompts, and logs the verifier's
`val/accuracy` (reward 1) and `val/reward`, as RL's validation does: a falling loss on the answers says little
about whether the greedy answers are right (docs/rl.md, "SFT then RL").

    zoo fit --config configs/sft/arithmetic.yaml --model.init_from runs/pretrain/last.ckpt
"""

from __future__ import annotations

import torch
from torch import Tensor

from zoo.batch import IGNORE_INDEX, GroupBatch
from zoo.datamodules.chat import chat_document
from zoo.datamodules.conversations import ConversationDataModule, ConversationSource
from zoo.datamodules.documents import decode_text
from zoo.datamodules.sequence import TextSegment
from zoo.models.elastic import ElasticSampler
from zoo.models.unified import UnifiedModel
from zoo.parallel import Parallelism
from zoo.tasks.optim import LRSchedulerCallable, OptimizerCallable
from zoo.tasks.pretrain import SamplingConfig, UnifiedPretraining


class SupervisedFineTuning(UnifiedPretraining):
    """`UnifiedPretraining` on conversations, the loss on the assistant's turns (module docstring).

    Args: those of `UnifiedPretraining`, with SFT's defaults (a lower peak rate, a short warm-up);
    `init_from` is the usual start (a pretraining checkpoint, export or hub id; a vocabulary without role
    tokens grows by them, `zoo.init_from`). The model's vocabulary must have the role tokens (`chat: true`).
    greedy_prompts: held-out ("val") conversations of each verifiable source answered greedily at every
        validation (0: none; fewer when the source has fewer).
    greedy_max_new_tokens: the answers' budget (tokens).
    """

    def __init__(
        self,
        model: UnifiedModel,
        elastic: ElasticSampler | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
        sampling: SamplingConfig = SamplingConfig(),
        parallel: Parallelism = Parallelism(),
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        init_from: str | None = None,
        greedy_prompts: int = 64,
        greedy_max_new_tokens: int = 32,
    ) -> None:
        if greedy_prompts < 0 or greedy_max_new_tokens < 1:
            raise ValueError(
                f"greedy_prompts must be >= 0 and greedy_max_new_tokens >= 1, got {greedy_prompts} and "
                f"{greedy_max_new_tokens}"
            )
        if not model.vocab.chat:
            raise ValueError(
                "SFT trains the chat format: the model's vocab needs the role tokens (vocab.chat: true); "
                "init_from a model pretrained without them adds them"
            )
        super().__init__(
            model, elastic, lr, weight_decay, betas, warmup_steps, min_lr_ratio, sampling, parallel,
            optimizer=optimizer, lr_scheduler=lr_scheduler, init_from=init_from,
        )  # fmt: skip
        self.greedy_prompts, self.greedy_max_new_tokens = greedy_prompts, greedy_max_new_tokens

    def setup(self, stage: str) -> None:
        datamodule = getattr(self._trainer, "datamodule", None)
        if datamodule is not None and not isinstance(datamodule, ConversationDataModule):
            raise TypeError(
                f"SupervisedFineTuning trains on conversations (ConversationDataModule), got "
                f"{type(datamodule).__name__}: with other data it would put the loss on every token"
            )
        super().setup(stage)

    def training_step(self, batch: GroupBatch, batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        # The share of positions with a text target: the assistant's text; user turns and padding carry none.
        answered = (batch.targets["text"] != IGNORE_INDEX).float().mean()
        self.log("train/answer_fraction", answered, on_step=True, batch_size=batch.batch_size)
        return loss

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        datamodule = getattr(self._trainer, "datamodule", None)
        if self.greedy_prompts == 0 or self._trainer.sanity_checking or datamodule is None:
            return
        scored = {
            type(source).__name__: self.greedy_rewards(datamodule, source)
            for source in datamodule.sources
            if source.verifiable and source.count("val")
        }
        if not scored:
            return
        every = [r for rewards in scored.values() for r in rewards]
        self.log("val/accuracy", sum(r >= 1.0 for r in every) / len(every), batch_size=len(every))
        self.log("val/reward", sum(every) / len(every), batch_size=len(every))
        if len(scored) > 1:
            for name, rewards in scored.items():
                self.log(f"val/{name}/accuracy", sum(r >= 1.0 for r in rewards) / len(rewards))

    @torch.no_grad()
    def greedy_rewards(self, datamodule: ConversationDataModule, source: ConversationSource) -> list[float]:
        """The verifier's reward of the greedy answer to each of the first `greedy_prompts` held-out
        conversations of `source`: every turn but the last (the assistant's reference answer) is the prompt,
        in the chat format."""
        maker, vocab = datamodule.maker(), self.model.vocab
        prompts = []
        for index in range(min(self.greedy_prompts, source.count("val"))):
            turns = source.conversation("val", index, 0, datamodule.spec)
            name = f"{type(source).__name__} val {index}"
            if turns[-1].role != "assistant":
                raise ValueError(f"{name}: a verifiable conversation must end with the assistant's answer")
            document = chat_document(maker, turns[:-1])
            if not all(isinstance(segment, TextSegment) for segment in document):
                raise ValueError(f"{name}: greedy validation answers text prompts; this one holds media")
            prompts.append([i for segment in document for i in segment.ids])
        rewards = []
        for start in range(0, len(prompts), 64):
            batch = prompts[start : start + 64]
            outs = self.model.generate(batch, self.greedy_max_new_tokens, temperature=0.0)
            for offset, ids in enumerate(outs):
                ids = ids[: ids.index(vocab.eos_id)] if vocab.eos_id in ids else ids
                answer = decode_text(datamodule.tokenizer, vocab, ids)
                rewards.append(source.verify("val", start + offset, answer))
        return rewards

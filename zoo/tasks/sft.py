"""Supervised fine-tuning (SFT, issue 18 item 1): the unified model learns to answer conversations.

`SupervisedFineTuning` is a thin subclass of `UnifiedPretraining`: the same step, losses, elastic draws,
parallelism and checkpoints. What makes it SFT is the data: `ConversationDataModule` lays every conversation
out in the chat format with targets only on the assistant's turns (`chat_document(answers_predicted=True)`),
so the text, NFSP and NCP losses the step already computes are the losses of what the assistant says, writes,
draws or speaks, and nothing of the user's turns. A subclass rather than a mode of pretraining because it
refuses what would silently train something else (a vocabulary without role tokens, data that is not
conversations) and logs the share of positions that carry loss, which pretraining has no use for.

    zoo fit --config configs/sft/arithmetic.yaml --model.init_from runs/pretrain/last.ckpt
"""

from __future__ import annotations

from torch import Tensor

from zoo.batch import IGNORE_INDEX, GroupBatch
from zoo.datamodules.conversations import ConversationDataModule
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
    ) -> None:
        if not model.vocab.chat:
            raise ValueError(
                "SFT trains the chat format: the model's vocab needs the role tokens (vocab.chat: true); "
                "init_from a model pretrained without them adds them"
            )
        super().__init__(
            model, elastic, lr, weight_decay, betas, warmup_steps, min_lr_ratio, sampling, parallel,
            optimizer=optimizer, lr_scheduler=lr_scheduler, init_from=init_from,
        )  # fmt: skip

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

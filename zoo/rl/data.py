"""RL data: a source of queries for the rollout schedulers, with the tokenizer that turns them into ids.

`QueryDataModule` is the base of what `data:` names in `configs/rl/*.yaml`: `RLDataModule` (text tasks
with exact answers, here) and `ShapesRLDataModule` (image / speech / clip to caption, caption to image
and to speech: `zoo.rl.data_shapes`). It serves the schedulers (`next_queries`, `encode_prompt`: the
`QuerySource` protocol of `zoo.rl.schedulers`), the task (the completion text a verifier reads, held-out
queries for validation) and Lightning (a train loader whose items only count RL steps, a validation
loader of held-out queries). The order of training queries is a seeded permutation per pass over the
pool, and the position in it travels in checkpoints.

The tokenizer is, in order of preference: the one stored with the starting weights (`RLTask` hands it
over from `init_from`), a file given as `tokenizer` (a tokenizer JSON, a Lightning checkpoint or a hub
directory), or a byte-level BPE trained on the training texts (prompt + reference solution).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

import lightning as L
from torch import Tensor
from torch.utils.data import DataLoader

from zoo.batch import Modality
from zoo.datamodules.sequence import Segment, VisualSegment
from zoo.rl.hints import HintController
from zoo.rl.prompts import Prompt
from zoo.rl.records import Query
from zoo.rl.tasks_text import TextTasks, training_text
from zoo.tokenizers.text import TextTokenizer
from zoo.tokenizers.vocab import UnifiedVocab

if TYPE_CHECKING:
    from zoo.rl.envs.protocol import Environment


def load_any_tokenizer(path: str | Path) -> TextTokenizer:
    """A tokenizer from a tokenizer JSON, a Lightning checkpoint (the datamodule state in it), or a hub
    directory (its tokenizer.json). Errors name the path and what was expected."""
    path = Path(path)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return TextTokenizer.load(path / "tokenizer.json")
    if path.suffix == ".ckpt" or path.is_dir():
        from zoo.hub import load_lightning_checkpoint

        _, tokenizer = load_lightning_checkpoint(path)
        if tokenizer is None:
            raise ValueError(f"{path}: the checkpoint holds no tokenizer (no datamodule state with one)")
        return tokenizer
    if path.suffix == ".json":
        return TextTokenizer.load(path)
    raise ValueError(f"tokenizer {path}: expected a tokenizer .json, a Lightning .ckpt or a hub directory")


class QueryDataModule(L.LightningDataModule):
    """RL queries: a training pool served in seeded order, held-out queries, the tokenizer; subclasses
    say what the queries are (`make_queries`), which texts a tokenizer is trained on (`training_texts`)
    and, for prompts with media, what the policy sees (`base_prompt`, `encode_prompt`), and, where they
    ask for video, how many frames a clip has (`video_frames`; None: the data holds no clips).

    Args:
        vocab: the model's unified vocabulary.
        train_size: distinct training queries, cycled through in a new seeded order every pass.
        heldout_size: held-out queries for validation (never a training prompt).
        seed: selects the queries and their order.
        tokenizer: tokenizer JSON, Lightning checkpoint or hub directory; None trains a BPE on the
            training texts (unless the starting checkpoint brings one).
        tokenizer_size: vocabulary of that trained BPE.
        steps_per_epoch: RL steps per Lightning epoch (the train loader only counts steps).
        val_batch_size: held-out queries per validation batch.
    """

    def __init__(
        self,
        vocab: UnifiedVocab = UnifiedVocab(),
        train_size: int = 1024,
        heldout_size: int = 128,
        seed: int = 0,
        tokenizer: str | None = None,
        tokenizer_size: int = 320,
        steps_per_epoch: int = 1000,
        val_batch_size: int = 64,
    ) -> None:
        super().__init__()
        if train_size < 1 or heldout_size < 1:
            raise ValueError(f"train_size and heldout_size must be >= 1, got {train_size} and {heldout_size}")
        if steps_per_epoch < 1 or val_batch_size < 1:
            raise ValueError("steps_per_epoch and val_batch_size must be >= 1")
        self.vocab = vocab
        self.video_frames: int | None = None
        self.train_size, self.heldout_size, self.seed = train_size, heldout_size, seed
        self.tokenizer_path, self.tokenizer_size = tokenizer, tokenizer_size
        self.steps_per_epoch, self.val_batch_size = steps_per_epoch, val_batch_size
        self.tokenizer: TextTokenizer | None = None
        self.hints: HintController | None = None  # set by RLTask when AHRL is on
        self.step = 0  # the RL step hints are computed for (set by RLTask)
        self._train: list[Query] | None = None
        self._heldout: list[Query] | None = None
        self._pass, self._cursor = 0, 0
        self._order: list[int] = []
        self._base: dict[str, list[int]] = {}

    # -- what subclasses define ------------------------------------------------------------------------
    def make_queries(self, split: str, n: int) -> list[Query]:
        """n queries of split "train" or "heldout" (disjoint), deterministic in the seed."""
        raise NotImplementedError

    def training_texts(self) -> list[str]:
        """What a tokenizer is trained on when none is given."""
        raise NotImplementedError

    # -- queries ---------------------------------------------------------------------------------------
    def train_queries(self) -> list[Query]:
        if self._train is None:
            self._train = self.make_queries("train", self.train_size)
        return self._train

    def heldout_queries(self) -> list[Query]:
        if self._heldout is None:
            self._heldout = self.make_queries("heldout", self.heldout_size)
        return self._heldout

    def _permutation(self, n_pass: int) -> list[int]:
        order = list(range(self.train_size))
        random.Random(self.seed * 1_000_003 + n_pass).shuffle(order)
        return order

    def next_queries(self, n: int) -> list[Query]:
        """The next n training queries of the seeded order (a new permutation every pass over the pool)."""
        pool, out = self.train_queries(), []
        while len(out) < n:
            if not self._order:
                self._order = self._permutation(self._pass)
            if self._cursor >= len(self._order):
                self._pass, self._cursor = self._pass + 1, 0
                self._order = self._permutation(self._pass)
            out.append(pool[self._order[self._cursor]])
            self._cursor += 1
        return out

    # -- tokens ----------------------------------------------------------------------------------------
    def use_tokenizer(self, tokenizer: TextTokenizer) -> None:
        """Adopt the tokenizer of the starting weights (RLTask calls this with `init_from`'s)."""
        self._check_size(tokenizer)
        self.tokenizer, self._base = tokenizer, {}

    def _check_size(self, tokenizer: TextTokenizer) -> None:
        if tokenizer.vocab_size > self.vocab.text_size:
            raise ValueError(
                f"the tokenizer has {tokenizer.vocab_size} ids but vocab.text_size is {self.vocab.text_size}"
            )

    def ensure_tokenizer(self) -> TextTokenizer:
        if self.tokenizer is None:
            if self.tokenizer_path:
                tokenizer = load_any_tokenizer(self.tokenizer_path)
            else:
                texts = self.training_texts()
                tokenizer = TextTokenizer.train(texts, vocab_size=self.tokenizer_size, min_frequency=2)
            self._check_size(tokenizer)
            self.tokenizer = tokenizer
        return self.tokenizer

    def encode_text(self, text: str) -> list[int]:
        """Unified ids of a text (no specials)."""
        return self.vocab.text_to_unified(self.ensure_tokenizer().encode(text)).tolist()

    def base_prompt_ids(self, query: Query) -> list[int]:
        """`<bos>` + the prompt's unified ids, without a hint; with role tokens in the vocabulary, the chat
        format's user turn and the assistant's opening (`<bos> <|user|> prompt <|assistant|>`, as
        `zoo.datamodules.chat.chat_document` lays out a conversation for generation)."""
        if query.id not in self._base:
            ids = self.encode_text(query.prompt)
            if self.vocab.chat:
                ids = [self.vocab.special("<|user|>"), *ids, self.vocab.special("<|assistant|>")]
            self._base[query.id] = [self.vocab.bos_id, *ids]
        return self._base[query.id]

    def base_prompt(self, query: Query) -> Prompt:
        """What the policy continues without a hint: unified ids here, a Document with media in subclasses
        that have them (`zoo.rl.prompts`)."""
        return self.base_prompt_ids(query)

    def hint_ids(self, query: Query) -> list[int]:
        """The AHRL hint of the current step (empty without hints)."""
        if self.hints is None:
            return []
        return self.hints.hint(query.id, query.solution, self.step, self.encode_text)

    def encode_prompt(self, query: Query) -> Prompt:
        """What the policy continues: `<bos>` + prompt + the AHRL hint of the current step (if any)."""
        return [*self.base_prompt_ids(query), *self.hint_ids(query)]

    def read(self, pixels: Tensor) -> Segment:
        """An image `[3, H, W]` or a video `[3, T, H, W]` as understanding reads it (what a reading reward
        scores, `zoo.rl.reading_reward`): here as the visual tokenizer's codes; data whose model reads
        images through the vision encoder says so."""
        return VisualSegment(pixels, predict=False)

    def environment(self) -> Environment | None:
        """What takes part in the responses besides the policy (a tool: `zoo.rl.envs.tools`); None here."""
        return None

    def decode(self, ids: list[int]) -> str:
        """Unified ids -> text, special tokens dropped."""
        tokenizer = self.ensure_tokenizer()
        offset, text = self.vocab.text_offset, self.vocab.text_range()
        return tokenizer.decode([i - offset for i in ids if i in text and i - offset < tokenizer.vocab_size])

    def completion_text(self, prompt_ids: list[int], response_ids: list[int], hint_len: int) -> str:
        """What the verifier reads: the hint (the start of the reference solution) and the response."""
        hint = prompt_ids[len(prompt_ids) - hint_len :] if hint_len > 0 else []
        return self.decode(hint + response_ids)

    def token_modality(self, ids: list[int]) -> list[int]:
        """A `Modality` per unified id (specials count as text), for per-modality IcePop bounds."""
        visual, audio = self.vocab.visual_range(), self.vocab.audio_range()
        return [
            int(Modality.IMAGE) if i in visual else int(Modality.AUDIO) if i in audio else int(Modality.TEXT)
            for i in ids
        ]

    # -- Lightning -------------------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        self.ensure_tokenizer()

    def train_dataloader(self) -> DataLoader:
        """Step counters only: the schedulers draw queries from this module through `next_queries`."""
        return DataLoader(range(self.steps_per_epoch), batch_size=None, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.heldout_queries(), batch_size=self.val_batch_size, collate_fn=list)

    def test_dataloader(self) -> DataLoader:
        """`zoo test` scores the held-out queries too: RL has one held-out set (ShapesWorld's
        `heldout_split: test` makes it the unseen colour-shape pairs)."""
        return self.val_dataloader()

    def state_dict(self) -> dict[str, object]:
        state: dict[str, object] = {"pass": self._pass, "cursor": self._cursor}
        if self.tokenizer is not None:
            state["tokenizer"] = self.tokenizer.to_json()
        return state

    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        if "tokenizer" in state_dict:
            self.tokenizer = TextTokenizer.from_json(str(state_dict["tokenizer"]))
            self._base = {}
        self._pass, self._cursor = int(state_dict.get("pass", 0)), int(state_dict.get("cursor", 0))
        self._order = self._permutation(self._pass)


class RLDataModule(QueryDataModule):
    """Text tasks with exact answers as RL queries.

    Args:
        tasks: task names of `zoo.rl.tasks_text.GENERATORS`.
        difficulties: difficulty levels of every task.
        vocab .. val_batch_size: as `QueryDataModule`.
        heldout_fraction: share of the prompt space reserved for held-out queries.
    """

    def __init__(
        self,
        tasks: tuple[str, ...] = ("add",),
        difficulties: tuple[int, ...] = (1,),
        vocab: UnifiedVocab = UnifiedVocab(),
        train_size: int = 1024,
        heldout_size: int = 128,
        seed: int = 0,
        heldout_fraction: float = 0.1,
        tokenizer: str | None = None,
        tokenizer_size: int = 320,
        steps_per_epoch: int = 1000,
        val_batch_size: int = 64,
    ) -> None:
        super().__init__(
            vocab, train_size, heldout_size, seed, tokenizer, tokenizer_size, steps_per_epoch, val_batch_size
        )
        self.tasks = TextTasks(tuple(tasks), tuple(difficulties), seed, heldout_fraction)

    def make_queries(self, split: str, n: int) -> list[Query]:
        return self.tasks.queries(split, n)

    def training_texts(self) -> list[str]:
        return [training_text(q) for q in self.train_queries()]

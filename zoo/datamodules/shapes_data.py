"""ShapesWorld as training data: the embedded world needs no download (DESIGN.md, "ShapesWorld").

Stage 1 (text): every scene becomes its caption, a document `<bos> caption <eos>`. The test split
draws scenes that contain held-out (colour, shape) pairs, so it measures composition, not recall.
The image, video and audio issues add documents that pair a caption with its rendering.
"""

from __future__ import annotations

from zoo.datamodules.documents import DocumentDataModule
from zoo.tokenizers.text import TextTokenizer
from zoo.tokenizers.vocab import UnifiedVocab
from zoo.world.scenes import Scene, ShapesWorld, caption, parse_caption


class ShapesDataModule(DocumentDataModule):
    """ShapesWorld captions as documents.

    Args:
        vocab: the model's unified vocabulary.
        world_seed: which world (the held-out pairs and every scene follow from it).
        min_objects: fewest objects per scene.
        max_objects: most objects per scene.
        train_size: training scenes per epoch (indices 0 .. train_size-1 of the train split).
        val_size: validation scenes (val split) and test scenes (test split, held-out pairs).
        tokenizer: a tokenizer JSON; None trains a BPE of `tokenizer_size` ids on training captions.
        tokenizer_size: vocabulary of the trained tokenizer (must fit `vocab.text_size`).
        seq_len: packed row length.
        batch_size: documents (captions) per batch.
        bpe_dropout: BPE-dropout probability on training documents.
        num_workers: dataloader workers.
        seed: shuffling and dropout seed.
        prompts: caption beginnings that `zoo predict` continues (default: free generation).
    """

    def __init__(
        self,
        vocab: UnifiedVocab = UnifiedVocab(),
        world_seed: int = 0,
        min_objects: int = 1,
        max_objects: int = 3,
        train_size: int = 8192,
        val_size: int = 256,
        tokenizer: str | None = None,
        tokenizer_size: int = 320,
        seq_len: int = 128,
        batch_size: int = 32,
        bpe_dropout: float = 0.0,
        num_workers: int = 0,
        seed: int = 0,
        prompts: list[str] | None = None,
    ) -> None:
        super().__init__(vocab, seq_len, batch_size, bpe_dropout, False, num_workers, seed, prompts)
        if train_size < 1 or val_size < 1:
            raise ValueError(f"train_size and val_size must be >= 1, got {train_size} and {val_size}")
        self.world = ShapesWorld(seed=world_seed, min_objects=min_objects, max_objects=max_objects)
        self.train_size, self.val_size = train_size, val_size
        self.tokenizer_path, self.tokenizer_size = tokenizer, tokenizer_size
        self._captions: dict[str, list[str]] = {}

    def texts(self, split: str) -> list[str]:
        if split not in self._captions:
            n = self.train_size if split == "train" else self.val_size
            self._captions[split] = [self.world.caption(s) for s in self.world.scenes(split, n)]
        return self._captions[split]

    def make_tokenizer(self) -> TextTokenizer:
        if self.tokenizer_path:
            return TextTokenizer.load(self.tokenizer_path)
        return TextTokenizer.train(
            self.texts("train")[:4096], vocab_size=self.tokenizer_size, min_frequency=2
        )

    def score_text(self, text: str) -> dict[str, float]:
        """A generated caption is grammatical when the ShapesWorld parser reads a scene from it; novel when
        that scene's caption is not among the training captions."""
        objects = parse_caption(text)
        if objects is None:
            return {"grammatical": 0.0, "novel": 0.0}
        if not hasattr(self, "_train_set"):
            self._train_set = set(self.texts("train"))
        canonical = caption(Scene(objects=objects, index=0, split="train"))
        return {"grammatical": 1.0, "novel": float(canonical not in self._train_set)}

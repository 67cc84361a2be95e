"""Every stage starts from the last: `init_from` for continued pretraining, SFT and RL (issue 18, item 2).

    tokenizer = load_starting_weights(model, "runs/pretrain/last.ckpt")   # or an exported folder, a hub id

The source is a Lightning checkpoint of a zoo task (a `.ckpt` file or an FSDP2 distributed folder), a folder
`zoo export` / `save_pretrained` wrote, or a Hugging Face Hub repo id (downloaded, or read from the local
cache with `HF_HUB_OFFLINE=1`). Either way the source model is rebuilt through the hub's allow-list and read
weights-only (`zoo.hub`): loading executes nothing.

Strict: every tensor of the model being trained must come from the source with the same shape, and every
tensor of the source must land somewhere; otherwise a `ValueError` names the missing, unexpected and
mismatched keys. One difference is bridged, and logged: a source trained without role tokens
(`UnifiedVocab.chat` false) starting a chat model (SFT). The role tokens sit after the other specials
(`zoo.tokenizers.vocab`), so the source's text rows move up by three; the three new rows of the text
embedding and of the text head's output are the mean of the source's text rows (a new token starts as "some
text": its logit is the average text logit, and its embedding a typical input), and every other row is the
source's own. Any other difference of vocabularies is refused.

A model built on `meta` (`zoo.meta_init`, as `zoo fit` builds it under FSDP2) reads its source deferred too:
the source's weights stay in their memory-mapped files, and each tensor is read when `materialize` replays it
into this rank's shard, so no rank holds a whole copy of the source (a distributed checkpoint folder excepted:
torch.distributed.checkpoint reads its tensors into memory).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from zoo.hub import from_pretrained, load_lightning_checkpoint, load_tokenizer
from zoo.meta_init import deferred_init, is_deferred, value_of
from zoo.models.unified import UnifiedModel
from zoo.tokenizers.text import TextTokenizer
from zoo.tokenizers.vocab import CHAT_TOKENS, UnifiedVocab

log = logging.getLogger(__name__)

# The tensors with one row per id of the text head (`UnifiedVocab.text_head_size`): what vocabulary growth
# touches. Everything else of a unified model is independent of the role tokens.
VOCAB_ROWS: tuple[str, ...] = ("text_embed.weight", "text_head.output.weight")


@dataclass(frozen=True)
class StartingWeights:
    """What `load_starting_weights` did: the source, its tokenizer, the tensors loaded and those left fresh
    (the role rows a vocabulary grew by, as `key[rows]`)."""

    source: str
    tokenizer: TextTokenizer | None
    loaded: int
    fresh: tuple[str, ...] = ()


def read_source(
    source: str | Path, local_files_only: bool = False
) -> tuple[UnifiedModel, TextTokenizer | None]:
    """The model and tokenizer of a starting point: a `.ckpt` (or distributed checkpoint folder), an exported
    folder, or a hub repo id. Errors name the source and what was expected."""
    path = Path(source)
    if path.is_file() or (path / "meta.pt").is_file():
        if path.is_file() and path.suffix != ".ckpt":
            raise ValueError(
                f"init_from {source}: a file must be a Lightning .ckpt; give a folder for an export"
            )
        return load_lightning_checkpoint(path)
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(
            f"init_from {source}: this folder is neither an export (no config.json) nor a distributed "
            "checkpoint (no meta.pt)"
        )
    if not path.exists() and (path.is_absolute() or path.suffix or str(source).count("/") != 1):
        raise ValueError(
            f"init_from {source}: no such file or folder (and not a hub repo id, which is owner/name); "
            "expected a Lightning .ckpt, an exported folder or a hub repo id"
        )
    try:
        model = from_pretrained(source, local_files_only=local_files_only)
        return model, load_tokenizer(source, local_files_only=local_files_only)
    except (OSError, ValueError) as err:  # not found on the hub or in its cache, not a zoo export, ...
        raise ValueError(f"init_from {source}: {err}") from err


def grown_rows(weight: Tensor, source: UnifiedVocab) -> Tensor:
    """A text-head-sized `weight` [source.text_head_size, D] of a vocabulary without role tokens, with the
    role rows inserted after the other specials, each the mean of the source's text rows (module
    docstring)."""
    weight = value_of(weight)  # a deferred source's rows, read now: their mean is computed, not replayed
    specials, text = weight[: source.num_special], weight[source.text_offset : source.visual_offset]
    role = text.mean(0, keepdim=True).expand(len(CHAT_TOKENS), -1)
    return torch.cat([specials, role, weight[source.text_offset :]])


def adapt_state(
    state: Mapping[str, Tensor], source: UnifiedVocab, target: UnifiedVocab, where: str
) -> tuple[dict[str, Tensor], tuple[str, ...]]:
    """The source's state for a model of vocabulary `target`, and the rows left fresh. Equal vocabularies
    pass unchanged; a non-chat source of a chat target grows (module docstring); anything else is refused."""
    if source == target:
        return dict(state), ()
    if source.chat or not target.chat or replace(source, chat=True) != target:
        raise ValueError(
            f"init_from {where}: its vocabulary {source} does not fit the model's {target}; only role "
            "tokens may be added (a vocabulary with chat: false starting one with chat: true), every size "
            "must be the same"
        )
    adapted, fresh = dict(state), []
    rows = f"[{source.num_special}:{target.text_offset}]"
    for key in VOCAB_ROWS:
        if key in adapted:
            adapted[key] = grown_rows(adapted[key], source)
            fresh.append(key + rows)
    return adapted, tuple(fresh)


def check_fits(model: torch.nn.Module, state: Mapping[str, Tensor], where: str) -> None:
    """`ValueError` naming every missing, unexpected and mismatched tensor when `state` is not exactly the
    state of `model` (names and shapes)."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    mismatched = [
        f"{k} {list(state[k].shape)} (the model's: {list(own[k].shape)})"
        for k in sorted(set(own) & set(state))
        if state[k].shape != own[k].shape
    ]
    problems = []
    for name, keys in (("missing", missing), ("unexpected", unexpected), ("of another shape", mismatched)):
        if keys:
            shown = ", ".join(keys[:12]) + (f", ... ({len(keys) - 12} more)" if len(keys) > 12 else "")
            problems.append(f"{len(keys)} {name}: {shown}")
    if problems:
        raise ValueError(
            f"init_from {where}: its weights do not fit the model of this config (same architecture?): "
            + "; ".join(problems)
        )


def load_starting_weights(
    model: UnifiedModel, source: str | Path, local_files_only: bool = False
) -> StartingWeights:
    """Load the starting point `source` into `model`, strictly (module docstring); the rows it leaves fresh
    are logged and returned with the source's tokenizer (None when it holds none)."""
    where = str(source)
    # A deferred model: read the source deferred and record the copies (module docstring: no second copy).
    with deferred_init() if is_deferred(model) else nullcontext():
        loaded, tokenizer = read_source(source, local_files_only)
        state, fresh = adapt_state(loaded.state_dict(), loaded.vocab, model.vocab, where)
        check_fits(model, state, where)
        with torch.no_grad():
            model.load_state_dict(state, strict=True)
    if fresh:
        log.warning(
            "init_from %s: added the role tokens %s to its vocabulary; fresh rows (the mean of its text "
            "rows): %s; every other tensor loaded",
            where, " ".join(CHAT_TOKENS), ", ".join(fresh),
        )  # fmt: skip
    else:
        log.info("init_from %s: every tensor loaded (%d), none left fresh", where, len(state))
    return StartingWeights(where, tokenizer, len(state), fresh)


def hand_over_tokenizer(
    tokenizer: TextTokenizer | None, datamodule: object | None, vocab: UnifiedVocab
) -> None:
    """Give a datamodule the starting point's tokenizer (a task's `setup`): the ids the weights were trained
    on. Nothing when either is None or the datamodule keeps no tokenizer; `ValueError` when it does not
    fit."""
    if tokenizer is None or datamodule is None or not hasattr(datamodule, "tokenizer"):
        return
    if tokenizer.vocab_size > vocab.text_size:
        raise ValueError(
            f"init_from: its tokenizer has {tokenizer.vocab_size} ids but the vocabulary reserves "
            f"text_size={vocab.text_size}"
        )
    datamodule.tokenizer = tokenizer

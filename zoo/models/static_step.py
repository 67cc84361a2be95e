"""The static-shape text decode step, optionally compiled (issue 15, "Speed").

A batch-1 decode step of a small model is some two thousand small ops: Python and dispatch, not
arithmetic. The dynamic step (`zoo.models.decode.text_step`) slices the cache to its filled length and
rebuilds the group mask from the cached ids, so every token has new shapes and nothing can be compiled
once. `StaticTextStep` feeds the same positions with every shape fixed for the whole generation: the new
positions go to cache columns given as a tensor (`KVCache.reserve` on the host, `index_copy_` inside the
step), attention runs over the cache's whole preallocated width with the group rule masking the columns
not written yet (`UnifiedTransformer.static_context`), and no Python branch reads a tensor's value. One
trace then serves every token: `compile=True` runs the step through `torch.compile` (inductor; on CUDA
`mode="reduce-overhead"`, CUDA graphs), once per (model, rows, positions a step, cache width). Cache widths
are rounded up to `STATIC_LEN_MULTIPLE` (`static_cache_len`) so prompts of nearby lengths share a trace.

Masked columns get exactly zero attention weight, so the greedy tokens are the dynamic path's (tested
against it and against recomputation); the logits agree to float rounding, not bit for bit (the sums run
over more, zero, terms). The dynamic path stays the default for training, prefill and media steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from zoo.batch import Modality
from zoo.models.decode import Cursor, step_batch
from zoo.models.elastic import ElasticConfig
from zoo.models.kv_cache import KVCache

if TYPE_CHECKING:
    from zoo.models.decodable import DecodingModel

# Cache widths of a static decode are rounded up to a multiple of this: one compiled trace per bucket.
# A multiple of 16 also matters by itself: on CPU a compiled step at width 24 ran ~20x slower than at 16,
# 32 or 64 (one machine, torch 2.11), so the width is rounded even past the backbone's max_seq_len (the
# columns past it are never filled: only the cache's memory grows).
STATIC_LEN_MULTIPLE = 64


def static_cache_len(needed: int) -> int:
    """The cache width a static decode of `needed` positions uses: `needed` rounded up to a multiple of
    `STATIC_LEN_MULTIPLE`."""
    return -(-needed // STATIC_LEN_MULTIPLE) * STATIC_LEN_MULTIPLE


def _text_step(
    model: DecodingModel,
    cache: KVCache,
    elastic: ElasticConfig | None,
    ids: Tensor,
    t: Tensor,
    group: Tensor,
    at: Tensor,
) -> tuple[Tensor, dict[int, Tensor]]:
    """The traced body: `[R, n]` text ids after (t, group) `[R]` into cache columns `at..at+n`; returns
    their sampling logits `[R, n, V]` and per MoE layer the experts chosen `[R * n, k]`."""
    offsets = torch.arange(ids.shape[1], device=ids.device)
    t, group = t[:, None] + offsets, group[:, None] + offsets
    batch = step_batch(Modality.TEXT, t, t, t, group, ids)
    out = model.forward_hidden(batch, cache=cache, elastic=elastic, at=at)
    return model.sampling_logits(out.hidden), out.routing


def _compiled_text_step(device: torch.device):
    """`_text_step` through `torch.compile`: CUDA graphs on CUDA (`reduce-overhead`), inductor elsewhere.
    Static shapes (`dynamic=False`): a new (rows, width) is a new trace, never a symbolic one."""
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    return torch.compile(_text_step, mode=mode, dynamic=False)


class StaticTextStep:
    """Feeds text ids into `cache` at static shapes: `step(ids, cursor)` does what `decode.text_step` does
    with a cache (same positions, groups and cache contents) and returns the sampling logits. When compiled,
    each new shape of `ids` `[R, n]` or cache width is one more trace; the same shapes reuse it, also across
    instances and generations (`torch._dynamo` keeps up to `recompile_limit` traces, 8 by default, and runs
    eagerly past them).

    Args:
        model: the decoding model.
        cache: the cache the prompt was prefilled into; its width is the attention width of every step.
        elastic: run a sub-model, as `text_step` does.
        compile: run the step through `torch.compile` (`_compiled_text_step`); False runs it eagerly,
            which already saves the slicing and the mask rebuilt from the cached ids.
    """

    def __init__(
        self,
        model: DecodingModel,
        cache: KVCache,
        elastic: ElasticConfig | None = None,
        compile: bool = False,
    ) -> None:
        self.model, self.cache, self.elastic = model, cache, elastic
        self.cuda_graphs = compile and cache.device.type == "cuda"
        if self.cuda_graphs:
            # The step writes the cache in place: CUDA graphs replay only if its buffers never move.
            for buffer in cache.buffers():
                torch._dynamo.mark_static_address(buffer)
        self._run = _compiled_text_step(cache.device) if compile else _text_step

    def __call__(self, ids: Tensor, cursor: Cursor) -> tuple[Tensor, dict[int, Tensor]]:
        """Feed `[R, n]` text ids after `cursor`, one group each; returns their logits `[R, n, V]` (those of
        `model.sampling_logits`) and per MoE layer the experts of the `R * n` positions, row-major."""
        start = self.cache.reserve(ids.shape[1])
        at = torch.tensor(start, device=ids.device)
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        logits, routing = self._run(self.model, self.cache, self.elastic, ids, cursor.t, cursor.group, at)
        if self.cuda_graphs:
            # A CUDA graph's outputs are overwritten by its next replay: hand out copies.
            logits, routing = logits.clone(), {layer: chosen.clone() for layer, chosen in routing.items()}
        return logits, routing

"""The key/value cache of decoding, and every operation on it (DESIGN.md, "backbone"; issue 15).

One cache holds, for R rows decoded together, the keys and values of every layer at every position fed
so far, plus the (document, group) ids of those positions: the group mask of a new position is computed
against them (`zoo.batch.group_attention_mask`). Columns `[0, length)` are filled; rows are right-aligned,
so every row's newest position is the last column and a row that started shorter has `PAD_DOC` columns on
its left, which nothing attends to.

The cache changes only through its methods: a forward `extend`s it by its positions and each layer
`store`s its keys and values there; speculative decoding `truncate`s rejected drafts; continuous batching
`join`s rows prefilled apart, `select`s the rows that stay and `grow`s it when decoding outgrows it.

A static step (`zoo.models.static_step`, the compiled text decode) keeps every shape fixed from token to
token: it `reserve`s its columns on the host, then, inside the traced step, `write_ids` and `store` at a
column given as a tensor and attends over the whole preallocated width (`all_doc_id`, `all_group_id`,
the unfilled columns masked).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from zoo.batch import PAD_DOC


class KVCache:
    """A preallocated key/value cache of `n_layers` layers for `batch_size` rows of up to `max_len` positions.

    Args:
        n_layers: layers cached (the backbone's, or 1 for an MTP module).
        batch_size: rows.
        n_kv_heads: key/value heads.
        max_len: positions a row can hold before `grow`.
        head_dim: per-head width.
        dtype: of the keys and values.
        device: where the buffers live.
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        # One buffer per layer, not one tensor stacked over layers: a layer writes and reads its own, and a
        # compiled step never indexes a layer-stacked tensor (REFERENCES.md part D, section 1).
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self._k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self._v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self._doc_id = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)
        self._group_id = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)
        self._length = 0

    # -- what it holds --------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        """Columns filled (the same for every row: rows are right-aligned)."""
        return self._length

    @property
    def max_len(self) -> int:
        return self._doc_id.shape[1]

    @property
    def rows(self) -> int:
        return self._doc_id.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self._k[0].dtype

    @property
    def device(self) -> torch.device:
        return self._doc_id.device

    @property
    def doc_id(self) -> Tensor:
        """`[R, length]` document ids of the cached positions (a view: do not write it)."""
        return self._doc_id[:, : self._length]

    @property
    def group_id(self) -> Tensor:
        """`[R, length]` group ids of the cached positions (a view: do not write it)."""
        return self._group_id[:, : self._length]

    @property
    def all_doc_id(self) -> Tensor:
        """`[R, max_len]` document ids of every column, filled or not (a static step masks the unfilled)."""
        return self._doc_id

    @property
    def all_group_id(self) -> Tensor:
        """`[R, max_len]` group ids of every column, filled or not."""
        return self._group_id

    def buffers(self) -> list[Tensor]:
        """Every tensor the cache holds (CUDA graphs are told their addresses stay put)."""
        return [*self._k, *self._v, self._doc_id, self._group_id]

    # -- a forward --------------------------------------------------------------------------------------
    def extend(self, doc_id: Tensor, group_id: Tensor) -> int:
        """Take the next `n` columns for a forward of `[R, n]` positions with these ids; returns the first.
        Each layer then `store`s its keys and values there."""
        start, n = self._length, doc_id.shape[1]
        end = start + n
        if end > self.max_len:
            raise ValueError(f"cache holds {self.max_len} positions; {start} used + {n} new = {end}")
        self._doc_id[:, start:end] = doc_id
        self._group_id[:, start:end] = group_id
        self._length = end
        return start

    def reserve(self, n: int) -> int:
        """Take the next `n` columns for a static step, which writes their ids itself (`write_ids`);
        returns the first. The host's bookkeeping only: nothing is written here."""
        start, end = self._length, self._length + n
        if end > self.max_len:
            raise ValueError(f"cache holds {self.max_len} positions; {start} used + {n} new = {end}")
        self._length = end
        return start

    def write_ids(self, columns: Tensor, doc_id: Tensor, group_id: Tensor) -> None:
        """Write `[R, n]` ids at `columns` `[n]` (a tensor: the shapes, not the values, are what a compiled
        step sees, so it runs unchanged at every column)."""
        self._doc_id.index_copy_(1, columns, doc_id)
        self._group_id.index_copy_(1, columns, group_id)

    def store(self, layer: int, start: int | Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write one layer's `[R, KVH, n, Dh]` keys and values from column `start`; returns that layer's keys
        and values of every position up to them (what the new positions attend over). With `start` a
        tensor (a static step) returns every column of the buffers: the caller's mask hides the unfilled."""
        if isinstance(start, Tensor):
            columns = start + torch.arange(k.shape[2], device=start.device)
            self._k[layer].index_copy_(2, columns, k)
            self._v[layer].index_copy_(2, columns, v)
            return self._k[layer], self._v[layer]
        end = start + k.shape[2]
        keys, values = self._k[layer], self._v[layer]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        return keys[:, :, :end], values[:, :, :end]

    def truncate(self, length: int) -> None:
        """Forget the positions from `length` on (rejected speculative drafts)."""
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a cache of length {self._length} to {length}")
        self._length = length

    # -- continuous batching ---------------------------------------------------------------------------
    def grow(self, extra: int) -> None:
        """Make room for `extra` more positions per row."""
        if extra < 1:
            raise ValueError(f"grow needs extra >= 1 columns, got {extra}")
        pad = list(self._k[0].shape)
        pad[2] = extra
        self._k = [torch.cat([k, k.new_zeros(pad)], dim=2) for k in self._k]
        self._v = [torch.cat([v, v.new_zeros(pad)], dim=2) for v in self._v]
        rows = self._doc_id.shape[0]
        self._doc_id = torch.cat([self._doc_id, self._doc_id.new_full((rows, extra), PAD_DOC)], dim=1)
        self._group_id = torch.cat([self._group_id, self._group_id.new_zeros((rows, extra))], dim=1)

    def select(self, rows: Sequence[int]) -> None:
        """Keep only `rows` (in that order), and drop the leading columns that are padding in all of them
        (rows that left took the longest histories with them)."""
        if not rows:
            raise ValueError("select needs at least one row (drop the cache instead)")
        index = torch.tensor(list(rows), device=self.device)
        used = (self._doc_id[index, : self._length] != PAD_DOC).any(dim=0)
        first = int(used.int().argmax()) if bool(used.any()) else self._length
        self._k = [k[index, :, first:] for k in self._k]
        self._v = [v[index, :, first:] for v in self._v]
        self._doc_id, self._group_id = self._doc_id[index, first:], self._group_id[index, first:]
        self._length -= first

    @classmethod
    def join(cls, caches: Sequence[KVCache], headroom: int = 0) -> KVCache:
        """The rows of `caches`, in order, in one new cache with `headroom` free columns: each row is
        right-aligned to the longest cache, the columns on its left are padding (`PAD_DOC`)."""
        if not caches:
            raise ValueError("join needs at least one cache")
        first = caches[0]
        length = max(c.length for c in caches)
        _, n_kv_heads, _, head_dim = first._k[0].shape
        rows = sum(c.rows for c in caches)
        joined = cls(len(first._k), rows, n_kv_heads, length + headroom, head_dim, first.dtype, first.device)
        joined._doc_id.fill_(PAD_DOC)
        at = 0
        for cache in caches:
            n, span = cache.length, slice(at, at + cache.rows)
            cols = slice(length - n, length)
            for layer in range(len(first._k)):
                joined._k[layer][span, :, cols] = cache._k[layer][:, :, :n]
                joined._v[layer][span, :, cols] = cache._v[layer][:, :, :n]
            joined._doc_id[span, cols] = cache._doc_id[:, :n]
            joined._group_id[span, cols] = cache._group_id[:, :n]
            at += cache.rows
        joined._length = length
        return joined

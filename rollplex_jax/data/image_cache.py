"""A byte-bounded LRU cache of preprocessed image patches, shared by the batches of one dataset.

Datasets load lazily (``dataset.load_dataset`` reads headers, not pixels), so each batch decodes and
patchifies its own images. The cache keeps the float32 patches of recently used images so that an image
seen again (a small dataset's next epoch, rows that share an image, the same prompt in eval) is not
decoded twice, while the memory it holds stays under ``max_bytes`` whatever the dataset's size. Keys are
the image path plus every preprocessing parameter that changes the patches; values are read-only arrays.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable

import numpy as np

DEFAULT_CACHE_BYTES = 1 << 30  # 1 GiB: ~14,000 56 px demo images, ~40 images at Qwen's max_pixels (5120 patches)


class PatchCache:
    """Least-recently-used ``key -> float32 patches`` with at most ``max_bytes`` of array data.

    An array larger than the whole bound is returned but not kept; ``max_bytes=0`` disables caching.
    ``hits``, ``misses`` and ``evictions`` count what happened; ``nbytes`` is what is held now.
    """

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES):
        if max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes} must be >= 0 (0 = no cache)")
        self.max_bytes = int(max_bytes)
        self._items: collections.OrderedDict[Hashable, np.ndarray] = collections.OrderedDict()
        self.nbytes = self.hits = self.misses = self.evictions = 0

    def get(self, key: Hashable, make: Callable[[], np.ndarray]) -> np.ndarray:
        """The cached array for ``key``, else ``make()`` (cached if it fits), read-only either way."""
        if key in self._items:
            self.hits += 1
            self._items.move_to_end(key)
            return self._items[key]
        self.misses += 1
        value = make()
        value.setflags(write=False)  # shared by every batch that reads it
        if value.nbytes <= self.max_bytes:
            self._items[key] = value
            self.nbytes += value.nbytes
            while self.nbytes > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self.nbytes -= old.nbytes
                self.evictions += 1
        return value

    def __len__(self) -> int:
        return len(self._items)

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._items), "bytes": self.nbytes, "max_bytes": self.max_bytes, "hits": self.hits,
                "misses": self.misses, "evictions": self.evictions}

"""Which prompts each step draws: a seeded permutation per epoch, resumable from a JSON-able position.

Kept apart from the dataset (``dataset.py``) because it only deals in indices: the sampler never sees a
row, so the lazy dataset can hand out any example by index and a resumed run draws exactly the batches
an uninterrupted one would have.
"""

from __future__ import annotations

import numpy as np


class PromptSampler:
    """Deterministic prompt order: a permutation per epoch from ``default_rng((seed, epoch))``.

    ``next_indices()`` returns the next ``batch_size`` indices; a batch that reaches the end
    of an epoch continues into the next epoch's permutation, so every example is used once
    per epoch (a batch larger than the dataset holds repeats). ``state()`` / ``from_state``
    round-trip (epoch, position), so a resumed run draws exactly the batches an
    uninterrupted one would have.
    """

    def __init__(self, n_examples: int, batch_size: int, seed: int, *, epoch: int = 0, position: int = 0):
        if n_examples < 1:
            raise ValueError(f"n_examples={n_examples} must be >= 1")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if epoch < 0 or not 0 <= position < n_examples:
            raise ValueError(f"epoch={epoch} must be >= 0 and position={position} in [0, {n_examples})")
        self.n_examples, self.batch_size, self.seed = n_examples, batch_size, seed
        self.epoch, self.position = epoch, position
        self._perm = self._permutation(epoch)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng((self.seed, epoch)).permutation(self.n_examples)

    def next_indices(self) -> np.ndarray:
        """The next ``batch_size`` example indices (int64)."""
        out = []
        need = self.batch_size
        while need:
            take = min(need, self.n_examples - self.position)
            out.append(self._perm[self.position:self.position + take])
            self.position += take
            need -= take
            if self.position == self.n_examples:
                self.epoch, self.position = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
        return np.concatenate(out).astype(np.int64)

    def state(self) -> dict[str, int]:
        """JSON-able position: pass it to ``from_state`` to continue from here."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "n_examples": self.n_examples, "batch_size": self.batch_size}

    @classmethod
    def from_state(cls, state: dict, *, n_examples: int | None = None) -> PromptSampler:
        """Rebuilds a sampler at a saved position.

        Args:
            state: A dict from ``state()``.
            n_examples: If given, the current dataset size; a mismatch with the saved one
                raises ValueError (the saved order would index a different dataset).
        """
        if n_examples is not None and n_examples != state["n_examples"]:
            raise ValueError(f"the sampler state was saved for {state['n_examples']} examples but the dataset "
                             f"now has {n_examples}; resume with the same dataset")
        return cls(int(state["n_examples"]), int(state["batch_size"]), int(state["seed"]),
                   epoch=int(state["epoch"]), position=int(state["position"]))

"""A step's batch as both sides see it: prompts in, rollouts out, and the engine protocol between them.

Prompts arrive already tokenised and preprocessed (numpy), exactly as the JAX programs see them, so the
engine and the trainer score the same tokens. An engine generates G answers per prompt with weights bound
from the actor (``layout.py`` says how); it knows nothing of JAX beyond receiving DLPack-capable arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy decoding (top_p/top_k ignored).

    ``first_prompt``: the index of this call's first prompt in the step's batch. Every engine seeds each
    answer by (``seed``, its prompt's index in the batch, its index among the prompt's answers), so a
    process decoding a share of the prompts samples what one process decoding all of them would.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    first_prompt: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = off)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.first_prompt < 0:
            raise ValueError(f"first_prompt={self.first_prompt} must be >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prompts:
    """B left-padded prompts with their images and videos (host arrays).

    input_ids, attention_mask: [B, T]; pixel_values: [N, patch_dim] patches of all images
    (batch order) then all videos, or None; image_grid_thw / video_grid_thw: [n, 3] or None;
    second_per_grid_ts: float32 [n_videos] seconds per temporal grid step of each video (Qwen2.5-VL's
    M-RoPE time scale: temporal_patch_size / sampled fps), or None (1.0 for every video, as transformers).
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    pixel_values: np.ndarray | None = None
    image_grid_thw: np.ndarray | None = None
    video_grid_thw: np.ndarray | None = None
    second_per_grid_ts: np.ndarray | None = None

    def __post_init__(self):
        if self.second_per_grid_ts is not None:
            n = 0 if self.video_grid_thw is None else len(self.video_grid_thw)
            if np.shape(self.second_per_grid_ts) != (n,):
                raise ValueError(f"second_per_grid_ts has shape {np.shape(self.second_per_grid_ts)}, the prompts have "
                                 f"{n} videos: give one value per video (video_grid_thw row), or None for 1.0 each")

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rollouts:
    """G answers for each of B prompts.

    response_ids: [B, G, T] right-padded with ``pad_token_id``; lengths: [B, G];
    finish_reasons: [B][G] "stop" (ended on a stop token, which is included) or "length";
    logprobs: [B, G, T] float32 engine log-probs of each sampled token under the distribution sampled
    from, ``log_softmax(logits / T)`` (greedy, T = 0: ``log_softmax(logits)``); the transformers engine's over the
    whole vocabulary, as the trainer's, vLLM's after its top-k / top-p truncation where those are on; 0 at padding.
    prefill_tokens: prompt tokens (padding excluded) the engine ran its model over, vision included; B x G
    times the prompts' tokens when every answer prefills its own prompt, fewer when answers share a prefill
    (-1: the engine does not say).
    """

    response_ids: np.ndarray
    lengths: np.ndarray
    finish_reasons: list[list[str]]
    logprobs: np.ndarray
    prefill_tokens: int = -1

    @property
    def mask(self) -> np.ndarray:
        t = self.response_ids.shape[-1]
        return (np.arange(t)[None, None, :] < self.lengths[..., None]).astype(np.int32)


def items_per_row(prompts: Prompts, token_id: int, grids: np.ndarray | None, merge: int) -> list[list[int]]:
    """Indices of the grids (images, or videos) that belong to each prompt row, in order.

    Rows own consecutive grids; a row with k pad tokens owns the next grids whose
    t*h*w / merge sum to k.
    """
    counts = ((prompts.input_ids == token_id) & (prompts.attention_mask > 0)).sum(1)
    tokens = [] if grids is None else (np.prod(grids, -1) // merge).tolist()
    out, g = [], 0
    for c in counts.tolist():
        row = []
        while c > 0:
            if g >= len(tokens):
                raise ValueError(f"prompts have more pad tokens (id {token_id}) than their grids account for")
            row.append(g)
            c -= tokens[g]
            g += 1
        out.append(row)
    return out


class Engine(Protocol):
    """A rollout engine bound to the actor's weights.

    ``layout`` names the engine's tensor layout (``"hf"``, ``"vllm"``, ``"vllm_text"``): the trainer describes
    that layout's tensors in terms of its own parameters (``rollplex_jax.weights.engine_layouts``), classifies them
    against the training shards, and hands each rank its ``RankTensor`` list with the shards (``bind``).
    """

    layout: str

    def bind(self, tensors: Sequence[Any], shards: Mapping[str, Sequence[Any]], *, refilled: bool = False) -> None:
        """(Re)binds the engine to the actor's current shards (``layout.RankTensor`` list, ``layout.Shard``s);
        ``refilled``: ``refill`` already copied these shards into the engine-owned (rebuilt) buffers."""

    def refill(self, shards: Mapping[str, Sequence[Any]]) -> int:
        """Copies the actor's new shards into the engine-owned (rebuilt) buffers without binding anything: run
        after an update, off the critical path. Returns the bytes copied (0 before the first bind)."""

    def release(self) -> None:
        """Drops every view of actor buffers, so JAX may donate them."""

    def generate(self, prompts: Prompts, n: int, sampling: SamplingParams) -> Rollouts:
        """Samples ``n`` answers per prompt."""

    def sharing_report(self) -> Any:
        """``layout.SharingReport`` of the last bind: counts and bytes aligned / view / rebuilt."""

"""Host-side assembly of a step's rows: full sequences (prompt ++ answer) for the serial schedule, mini-batch
row ranges and prompt-row selection for both schedules.

The serial baseline scores and trains on B*G rows, each a left-padded prompt followed
by one right-padded answer, with the prompt's images repeated for every answer (the
"per-sample prefix" the Rollplex schedule avoids). Rows are cut into micro-batches, each
turned into ``ModelInputs`` (M-RoPE positions, vision layout) on the host.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rollplex_contract.batch import Prompts, Rollouts, items_per_row
from rollplex_jax.config import Config, ModelConfig
from rollplex_jax.models.vl.model import InputOptions, ModelInputs, prepare_inputs


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """Rows [r0, r1) of the flattened B*G sequences, ready for a jit program.

    ``prompt_len`` is the (padded) prompt length Tp: logits at Tp-1+t predict answer token t.
    """

    rows: slice
    inputs: ModelInputs
    prompt_len: int
    response_ids: np.ndarray  # [R, Tr]
    response_mask: np.ndarray  # [R, Tr]


def micro_batches(cfg: ModelConfig, prompts: Prompts, rollouts: Rollouts, micro_batch: int,
                  rows: slice | None = None, opts: InputOptions | None = None) -> list[MicroBatch]:
    """Splits rows ``rows`` (default all) of the B*G (prompt ++ answer) rows into micro-batches of
    at most ``micro_batch`` rows (row r = prompt r // G, answer r % G); ``opts``: groups, packing (each
    micro-batch's rows packed padding-free where that saves a row, ``--packing``) and shape buckets, see
    ``prepare_inputs`` (its ``vision_region`` is set here)."""
    b, g, tr = rollouts.response_ids.shape
    spans = _grid_spans(cfg, prompts)
    ids = np.concatenate([np.repeat(prompts.input_ids, g, 0), rollouts.response_ids.reshape(b * g, tr)], 1)
    mask = np.concatenate([np.repeat(prompts.attention_mask, g, 0), rollouts.mask.reshape(b * g, tr)], 1)
    region = np.concatenate([np.ones((b * g, prompts.input_ids.shape[1]), bool), np.zeros((b * g, tr), bool)], 1)
    prompt_of_row = np.repeat(np.arange(b), g)
    out = []
    rows = rows or slice(0, b * g)
    for r0 in range(rows.start, rows.stop, micro_batch):
        r1 = min(r0 + micro_batch, rows.stop)
        pix, sel, secs = _select(prompts, spans, prompt_of_row[r0:r1])
        inputs = prepare_inputs(cfg, ids[r0:r1], mask[r0:r1], pix, *sel, second_per_grid_ts=secs,
                                opts=dataclasses.replace(opts or InputOptions(), vision_region=region[r0:r1]))
        out.append(MicroBatch(slice(r0, r1), inputs, prompts.input_ids.shape[1],
                              rollouts.response_ids.reshape(b * g, tr)[r0:r1], rollouts.mask.reshape(b * g, tr)[r0:r1]))
    return out


def row_slots(inputs: ModelInputs) -> np.ndarray:
    """[real tokens, token slots of the left-padded rows, token slots the decoder runs (packed rows when
    ``inputs.packing``)] of one pass over ``inputs``."""
    mask = np.asarray(inputs.attention_mask)
    run = mask.size if inputs.packing is None else int(np.prod(inputs.packing.segments.shape))
    return np.array([int((mask > 0).sum()), mask.size, run], np.int64)


def _grid_spans(cfg: ModelConfig, prompts: Prompts):
    """For images then videos: (grids, owner grids per prompt row, patch offsets into pixel_values)."""
    merge = cfg.vision.spatial_merge_size**2
    out, offset = [], 0
    for tok, grids in ((cfg.image_token_id, prompts.image_grid_thw), (cfg.video_token_id, prompts.video_grid_thw)):
        grids = np.zeros((0, 3), np.int64) if grids is None else np.asarray(grids)
        starts = offset + np.concatenate([[0], np.cumsum(np.prod(grids, -1))]).astype(np.int64)
        out.append((grids, items_per_row(prompts, tok, grids, merge), starts))
        offset = int(starts[-1])
    return out


def _select(prompts: Prompts, spans, rows) -> tuple[np.ndarray | None, list, np.ndarray | None]:
    """pixel_values, (image, video) grids and the videos' second_per_grid_ts of prompt rows ``rows`` (in that
    order, with repeats)."""
    pix, sel = [], []
    for grids, owner, starts in spans:
        its = [i for p in rows for i in owner[p]]
        pix += [prompts.pixel_values[starts[i]:starts[i + 1]] for i in its]
        sel.append(grids[its] if its else None)
    secs = None
    if prompts.second_per_grid_ts is not None and its:  # its: the videos (the last span)
        secs = np.asarray(prompts.second_per_grid_ts, np.float32)[its]
    return (np.concatenate(pix) if pix else None), sel, secs


def repeat_rows(cfg: ModelConfig, prompts: Prompts, g: int) -> Prompts:
    """Each prompt row (with its images and videos) repeated ``g`` times, in row order p0 x g, p1 x g, ..."""
    return select_rows(cfg, prompts, np.repeat(np.arange(prompts.batch_size), g))


def select_rows(cfg: ModelConfig, prompts: Prompts, rows) -> Prompts:
    """Prompt rows ``rows`` (in that order, repeats allowed) with their images and videos (and the videos'
    ``second_per_grid_ts``)."""
    rows = np.asarray(rows, np.int64)
    pix, (img, vid), secs = _select(prompts, _grid_spans(cfg, prompts), rows)
    return Prompts(input_ids=prompts.input_ids[rows], attention_mask=prompts.attention_mask[rows],
                   pixel_values=pix, image_grid_thw=img, video_grid_thw=vid, second_per_grid_ts=secs)


def mini_batch_rows(n_rows: int, n_mini: int) -> list[slice]:
    """Contiguous row ranges of the mini-batches (whole rows; sizes differ by at most one)."""
    edges = np.linspace(0, n_rows, n_mini + 1).round().astype(int)
    return [slice(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]


def vision_token_rows(cfg: ModelConfig, prompts: Prompts, rows) -> np.ndarray:
    """Indices, into the vision tower's output for all of ``prompts`` (image tokens of every image in batch
    order, then video tokens), of the tokens of prompt rows ``rows`` in the order ``select_rows`` gives them
    (the rows' images, then their videos): a frozen vision encoding sliced for a subset of the prompts."""
    merge = cfg.vision.spatial_merge_size**2
    out, offset = [], 0
    for tok, grids in ((cfg.image_token_id, prompts.image_grid_thw), (cfg.video_token_id, prompts.video_grid_thw)):
        grids = np.zeros((0, 3), np.int64) if grids is None else np.asarray(grids)
        counts = np.prod(grids, -1) // merge
        starts = offset + np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        owner = items_per_row(prompts, tok, grids, merge)
        out += [np.arange(starts[i], starts[i + 1]) for r in np.asarray(rows, np.int64) for i in owner[r]]
        offset = int(starts[-1])
    return np.concatenate(out) if out else np.zeros((0,), np.int64)


@dataclasses.dataclass(frozen=True)
class Block:
    """One micro-batch: answers [a0, a1) of each prefix row in [p0, p1)."""

    p0: int
    p1: int
    a0: int
    a1: int

    @property
    def index(self):
        return slice(self.p0, self.p1), slice(self.a0, self.a1)


def answer_blocks(p0: int, p1: int, n: int, micro_batch: int) -> list[Block]:
    """Micro-batches of at most ``micro_batch`` answers over prefix rows [p0, p1) of ``n`` answers each, in
    answer-row order (row p, answer a = flat row p * n + a): whole prefix rows, or a row's answers in chunks."""
    if micro_batch >= n:
        per = micro_batch // n
        return [Block(r, min(r + per, p1), 0, n) for r in range(p0, p1, per)]
    return [Block(r, r + 1, a, min(a + micro_batch, n)) for r in range(p0, p1) for a in range(0, n, micro_batch)]


def pad_prompts(prompts: Prompts, length: int) -> Prompts:
    """The prompt rows left-padded to ``length`` tokens (shape buckets): positions, outputs and losses are those
    of the unpadded rows (padding is masked everywhere; tested)."""
    extra = length - prompts.input_ids.shape[1]
    if extra <= 0:
        return prompts
    return dataclasses.replace(prompts, input_ids=np.pad(prompts.input_ids, ((0, 0), (extra, 0))),
                               attention_mask=np.pad(prompts.attention_mask, ((0, 0), (extra, 0))))


def pad_answers(rollouts: Rollouts, length: int, pad_id: int) -> Rollouts:
    """The answers right-padded to ``length`` tokens with ``pad_id`` (log-probs 0): the mask (from the lengths)
    keeps them out of every loss and metric."""
    extra = length - rollouts.response_ids.shape[-1]
    if extra <= 0:
        return rollouts
    widths = ((0, 0), (0, 0), (0, extra))
    return dataclasses.replace(rollouts, response_ids=np.pad(rollouts.response_ids, widths, constant_values=pad_id),
                               logprobs=np.pad(rollouts.logprobs, widths))


def input_options(cfg: Config) -> InputOptions:
    """How the run's scoring and training inputs are laid out: vision groups over ``dp x fsdp``, ``--packing``,
    ``--shape_buckets``."""
    return InputOptions(groups=cfg.mesh.batch_shards, pack=cfg.programs.packing, buckets=cfg.programs.buckets,
                        pack_cap=cfg.data.max_prompt_len + cfg.rollout.max_new_tokens)


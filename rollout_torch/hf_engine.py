"""Rollout with transformers' Qwen2.5-VL or Qwen3-VL, its weights bound zero-copy from the actor.

The torch model is built from the model's ``config.json`` dict (its ``model_type`` picks the class) on the
``meta`` device (no weight memory, no download); ``bind`` then installs the actor's shards as its parameters, as
the trainer classified them (``rollplex_contract.layout``): on one device every tensor is ``aligned`` (a DLPack
view: 100% shared, nothing rebuilt). With params sharded over a training mesh (e.g. fsdp=4) the
engine (no tensor parallelism) runs on the mesh's first device (in a job of several processes, each process's
own first device, decoding that process's share): replicated params are aligned views
of that device's shard, split ones are rebuilt (engine-owned full tensors, refilled in place on
every bind). Generation drives transformers' model itself (``hf_decode``): each distinct prompt of a chunk is
prefilled once (vision tower, prompt KV, M-RoPE positions as ``generate`` builds them, also for videos with their
``second_per_grid_ts``), its KV repeated to its answers, which decode together, finished ones leaving the batch;
each answer is sampled from its own seeded generator (``SeededSampler``), whatever rows share its batch, and
the chosen tokens' log-probs (of ``softmax(logits / T)``, untruncated: ``sample_step``) are kept step by step:
one step's [rows, vocab] at a time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from rollout_torch import hf_decode
from rollout_torch.weights import ShardedBinder, check_layout
from rollplex_contract.batch import Prompts, Rollouts, SamplingParams, items_per_row
from rollplex_contract.layout import RankTensor, Shard, SharingReport

# config.json's model_type -> transformers' (config, model) classes
MODEL_CLASSES = {"qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration),
                 "qwen3_vl": (Qwen3VLConfig, Qwen3VLForConditionalGeneration)}


def _build_meta_model(hf_config: Mapping[str, Any]):
    """The torch module tree with meta parameters and real (CPU) rotary buffers."""
    kind = hf_config.get("model_type", "qwen2_5_vl")
    if kind not in MODEL_CLASSES:
        raise ValueError(f"the transformers engine runs {', '.join(MODEL_CLASSES)}, not model_type={kind!r}")
    config_cls, model_cls = MODEL_CLASSES[kind]
    hf_cfg = config_cls(**hf_config)
    hf_cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = model_cls(hf_cfg)
    lm, vis = model.model.language_model, model.model.visual
    lm.rotary_emb = type(lm.rotary_emb)(config=lm.config)  # inv_freq buffers are computed, not loaded
    vis.rotary_pos_emb = type(vis.rotary_pos_emb)(vis.config)
    left = [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise RuntimeError(f"buffers left on the meta device: {left}")
    model.generation_config = GenerationConfig()
    return model.eval()


def _set_param(model, name: str, tensor: torch.Tensor) -> None:
    mod_name, _, leaf = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    with torch.inference_mode():  # keeps the wrapper an inference tensor: in-place ops on it raise
        mod._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)


class HFEngine:
    """transformers Qwen2.5-VL / Qwen3-VL generation over DLPack views of the actor's parameters.

    Args:
        hf_config: the model's ``config.json`` dict (Qwen2.5-VL or Qwen3-VL, transformers 5 layout).
        max_batch: most sequences generated at once.
        share_prefill: each distinct prompt of a chunk is prefilled once for its answers (False: once per
            answer, as ``generate`` does; for benchmarks: ``launch.bench_rollout``).
    """

    layout = "hf"  # one tensor per parameter, by transformers' in-memory names, no tensor parallelism

    def __init__(self, hf_config: Mapping[str, Any], *, max_batch: int = 64, share_prefill: bool = True):
        self.model = _build_meta_model(hf_config)
        c = self.model.config
        self.pad_token_id = int(c.text_config.pad_token_id)
        self.image_token_id, self.video_token_id = int(c.image_token_id), int(c.video_token_id)
        self.merge = int(c.vision_config.spatial_merge_size) ** 2
        self.max_batch, self.share_prefill = max_batch, share_prefill
        self.tensors: tuple[RankTensor, ...] = ()
        self.binder: ShardedBinder | None = None
        self._bound = False

    # --- weights ---------------------------------------------------------------------------------
    def bind(self, tensors: Sequence[RankTensor], shards: Mapping[str, Sequence[Shard]], *,
             refilled: bool = False) -> None:
        """Installs the actor's shards as the model's parameters: ``tensors`` is this rank's layout as the
        trainer classified it (engine rank at device position 0), ``shards`` the actor's addressable shards.
        Rebuilt buffers keep their storage across binds while the layout is unchanged; ``refilled``: ``refill``
        already copied these shards into them (only views are made here)."""
        if self._bound:
            self.release()
        tensors = tuple(tensors)
        if tensors != self.tensors:
            check_layout("HF", dict(self.model.named_parameters(remove_duplicate=False)), tensors)
            self.tensors, self.binder, refilled = tensors, ShardedBinder({0: tensors}), False
        bound = self.binder.bind(shards, fill=not refilled)[0]
        for name, t in bound.items():
            _set_param(self.model, name, t)
        del bound
        self.device = self.model.lm_head.weight.device
        for _, buf_owner in self.model.named_modules():  # rotary tables follow the weights' device
            for key, buf in list(buf_owner._buffers.items()):
                if buf is not None and buf.device != self.device:
                    buf_owner._buffers[key] = buf.to(self.device)
        self._bound = True

    def refill(self, shards: Mapping[str, Sequence[Shard]]) -> int:
        """Copies the actor's new shards into the rebuilt buffers without binding (after an update, off the
        critical path); bytes copied (0 before the first bind, which allocates them)."""
        return 0 if self.binder is None else self.binder.refill(shards)

    def release(self) -> None:
        """Replaces every bound parameter by a meta placeholder and checks no view survives."""
        for rt in self.tensors:
            p = self.model.get_parameter(rt.target)
            shape, dtype = p.shape, p.dtype
            del p  # a local reference would count as a live view
            _set_param(self.model, rt.target, torch.empty(shape, dtype=dtype, device="meta"))
        self._bound = False
        if self.binder is not None:
            self.binder.release()

    def sharing_report(self) -> SharingReport:
        """Counts and bytes per class as of the last bind (on one device: everything aligned)."""
        if self.binder is None:
            raise RuntimeError("sharing_report() needs a bind() first")
        return self.binder.report()

    def bound_tensors(self) -> dict[str, torch.Tensor]:
        """The engine's current parameter tensors by transformers' (in-memory) name (for checks)."""
        return {rt.target: self.model.get_parameter(rt.target) for rt in self.tensors}

    # --- generation --------------------------------------------------------------------------------
    def generate(self, prompts: Prompts, n: int, sampling: SamplingParams) -> Rollouts:
        """Samples ``n`` answers for each prompt, in chunks of at most max_batch rows holding whole groups where
        n <= max_batch: each prompt of a chunk is prefilled once for its answers (``hf_decode``)."""
        if not self._bound:
            raise RuntimeError("HFEngine.generate called before bind(params)")
        rows = np.repeat(np.arange(prompts.batch_size), n)
        per = n * max(1, self.max_batch // n) if n <= self.max_batch else self.max_batch  # whole groups per chunk
        chunks = [slice(i, i + per) for i in range(0, len(rows), per)]
        seeds = answer_seeds(sampling.seed, sampling.first_prompt, prompts.batch_size, n)
        outs = [self._generate_rows(prompts, rows[c], sampling, seeds[c]) for c in chunks]
        t = max(o[0].shape[1] for o in outs)
        ids = np.concatenate([np.pad(o[0], ((0, 0), (0, t - o[0].shape[1])), constant_values=self.pad_token_id)
                              for o in outs])
        logp = np.concatenate([np.pad(o[1], ((0, 0), (0, t - o[1].shape[1]))) for o in outs])
        lengths = np.concatenate([o[2] for o in outs])
        reasons = [r for o in outs for r in o[3]]
        b = prompts.batch_size
        return Rollouts(response_ids=ids.reshape(b, n, t), lengths=lengths.reshape(b, n),
                        finish_reasons=[reasons[i * n:(i + 1) * n] for i in range(b)],
                        logprobs=logp.reshape(b, n, t).astype(np.float32),
                        prefill_tokens=sum(o[4] for o in outs))

    def _inputs(self, prompts: Prompts, rows: np.ndarray) -> dict:
        merge = self.merge
        ids = torch.from_numpy(prompts.input_ids[rows]).long()
        types = torch.zeros_like(ids, dtype=torch.int32)
        types[ids == self.image_token_id] = 1
        types[ids == self.video_token_id] = 2
        kw = dict(input_ids=ids, attention_mask=torch.from_numpy(prompts.attention_mask[rows]).long(),
                  mm_token_type_ids=types)
        n_img_patches = 0 if prompts.image_grid_thw is None else int(np.prod(prompts.image_grid_thw, -1).sum())
        dtype = self.model.lm_head.weight.dtype
        for kind, tok, grids, off in (("image", self.image_token_id, prompts.image_grid_thw, 0),
                                      ("video", self.video_token_id, prompts.video_grid_thw, n_img_patches)):
            per_row = items_per_row(prompts, tok, grids, merge)
            items = [g for r in rows for g in per_row[r]]
            if not items:
                continue
            starts = off + np.concatenate([[0], np.cumsum(np.prod(grids, -1))])
            pix = np.concatenate([prompts.pixel_values[starts[g]:starts[g + 1]] for g in items])
            key = "pixel_values" if kind == "image" else "pixel_values_videos"
            kw[key] = torch.from_numpy(pix).to(dtype)
            kw[f"{kind}_grid_thw"] = torch.from_numpy(grids[items]).long()
            if kind == "video" and prompts.second_per_grid_ts is not None:  # float32, as transformers' processor
                kw["second_per_grid_ts"] = torch.from_numpy(np.asarray(prompts.second_per_grid_ts, np.float32)[items])
        return kw

    def _generate_rows(self, prompts: Prompts, rows: np.ndarray, sampling: SamplingParams, seeds: np.ndarray):
        """Answers for ``rows`` (prompt indices, prompt-major): each distinct prompt prefilled once (hf_decode)."""
        uniq, answers_of = np.unique(rows, return_inverse=True) if self.share_prefill else (rows, np.arange(len(rows)))
        kw = {k: v.to(self.device) for k, v in self._inputs(prompts, uniq).items()}
        stop = torch.tensor(list(sampling.stop_token_ids), dtype=torch.long, device=self.device)
        step = sample_step(sampling, seeds, self.device)
        with torch.no_grad():
            new, logp = hf_decode.decode(self.model, kw, torch.from_numpy(answers_of), step,
                                         sampling.max_new_tokens, stop, self.pad_token_id)
        prefilled = int(prompts.attention_mask[uniq].sum())
        return (*_finish(new.cpu().numpy(), logp.cpu().numpy(), sampling.stop_token_ids, self.pad_token_id), prefilled)


def sample_step(sampling: SamplingParams, seeds: np.ndarray, device: torch.device) -> hf_decode.StepFn:
    """One decode step's choice for the live rows: argmax of the raw scores (greedy) or of the warped scores
    plus each answer's own Gumbel noise (``SeededSampler``), and the chosen tokens' log-probs, in fp32, one
    step's [rows, V] at a time, under ``softmax(scores / T)`` over the whole vocabulary: the distribution the
    trainer trains on (``programs.actor.Spec``); top-k / top-p truncation, which only narrows what is sampled,
    is not applied to them. Greedy (T = 0): under the raw scores (T = 1)."""
    t = sampling.temperature or 1.0
    sampler = None if sampling.temperature == 0 else SeededSampler(sampling, seeds, device)

    def step(scores: torch.Tensor, live: torch.Tensor):
        logp = torch.log_softmax(scores / t, dim=-1)
        tok = (scores if sampler is None else sampler.noisy(scores, live)).argmax(-1)
        return tok, logp.gather(-1, tok[:, None])[:, 0]

    return step


def answer_seeds(seed: int, first_prompt: int, n_prompts: int, n: int) -> np.ndarray:
    """One seed per answer (prompt-major), from the call's seed, the prompt's index in the step's batch and
    the answer's index among its prompt's n: a share of the prompts samples the answers the whole batch would."""
    p = first_prompt + np.repeat(np.arange(n_prompts, dtype=np.int64), n)
    j = np.tile(np.arange(n, dtype=np.int64), n_prompts)
    return (np.int64(seed % 2**31) * 1_000_003 + p * 7_919 + j) % (2**63 - 1)


class SeededSampler(LogitsProcessor):
    """Temperature, top-k and top-p as transformers' sampling warpers, then Gumbel-max with one generator per
    row: argmax(warped logits + Gumbel noise) is a sample of the warped distribution (used under greedy
    decoding, so the rows' random streams are their own, independent of the batch)."""

    def __init__(self, sampling: SamplingParams, seeds: np.ndarray, device: torch.device):
        self.t, self.top_k, self.top_p = sampling.temperature, sampling.top_k, sampling.top_p
        self.gens = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return self.noisy(scores, range(len(self.gens)))

    def noisy(self, scores: torch.Tensor, rows) -> torch.Tensor:
        """The warped scores plus Gumbel noise for the rows ``rows`` of the call (their generators advance)."""
        x = scores.float() / self.t
        if self.top_k:
            kth = torch.topk(x, min(self.top_k, x.shape[-1]), dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, -float("inf"))
        if self.top_p < 1.0:
            srt, idx = torch.sort(x, descending=False, dim=-1)
            cum = srt.softmax(-1).cumsum(-1)
            drop = cum <= (1 - self.top_p)
            drop[..., -1:] = False  # keep at least the most likely token
            x = x.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), -float("inf"))
        u = torch.stack([torch.rand(x.shape[-1], generator=self.gens[int(r)], device=x.device) for r in rows])
        expo = -torch.log(u.clamp_min(1e-20))  # Exp(1)
        return x - torch.log(expo.clamp_min(1e-20))  # + Gumbel(0, 1)


def _finish(new: np.ndarray, logp: np.ndarray, stop_ids, pad_id: int):
    """Lengths (a stop token included), finish reasons, and padding/zeroed log-probs after each end."""
    t = new.shape[1]
    is_stop = np.isin(new, list(stop_ids)) if stop_ids else np.zeros_like(new, bool)
    first = np.where(is_stop.any(1), is_stop.argmax(1) + 1, t)
    mask = np.arange(t)[None] < first[:, None]
    reasons = ["stop" if s else "length" for s in is_stop.any(1)]
    return np.where(mask, new, pad_id), np.where(mask, logp, 0.0), first.astype(np.int32), reasons

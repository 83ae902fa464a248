"""Write a random-init Qwen2.5-VL checkpoint (HF layout) from a model config, e.g. the tiny one.

  python -m launch.make_tiny_checkpoint --out=DIR [--model_config=configs/models/tiny.json] [--seed=0]

The directory loads in transformers (`Qwen2_5_VLForConditionalGeneration.from_pretrained`) and
with `--model_dir=DIR` in our launchers.
"""

import jax
from absl import app, flags

from launch.flags import resolve_path
from rollplex_jax.config import ModelConfig
from rollplex_jax.models.qwen2_5_vl.hf_checkpoint import save_hf_checkpoint
from rollplex_jax.models.qwen2_5_vl.params import count_params, init_params

_OUT = flags.DEFINE_string("out", None, "Output directory.", required=True)
_MODEL_CONFIG = flags.DEFINE_string("model_config", "configs/models/tiny.json", "HF-style config.json.")
_SEED = flags.DEFINE_integer("seed", 0, "Init seed.", lower_bound=0)
_STD = flags.DEFINE_float("init_std", 0.02, "Std of the normal init of weight matrices.", lower_bound=0.0)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    path = resolve_path(_MODEL_CONFIG.value)
    if path is None:
        raise app.UsageError(f"--model_config={_MODEL_CONFIG.value!r}: file not found")
    cfg = ModelConfig.from_json_file(path)
    params = init_params(cfg, jax.random.key(_SEED.value), std=_STD.value)
    files = save_hf_checkpoint(_OUT.value, cfg, params)
    print(f"wrote {_OUT.value}: {count_params(params):,} parameters in {len(files)} file(s)")


if __name__ == "__main__":
    app.run(main)

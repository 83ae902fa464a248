"""--attention, --attention_block and --remat build Config.programs; bad values fail naming the flag."""

import pytest
from absl import app, flags

from launch import flags as launch_flags
from rollplex_jax.config import ProgramConfig


def _config(*args: str):
    fv = flags.FlagValues()
    launch_flags.define_flags(fv)
    fv(["prog", *args])
    return launch_flags.config_from_flags(fv)


def test_defaults_and_flags():
    assert _config().programs == ProgramConfig() == ProgramConfig(attention="blockwise", attention_block=512,
                                                                    remat="layer")
    cfg = _config("--attention=dense", "--attention_block=128", "--remat=dots")
    assert cfg.programs == ProgramConfig(attention="dense", attention_block=128, remat="dots")


def test_bad_values_name_the_flag():
    with pytest.raises(flags.IllegalFlagValueError):
        _config("--attention=flash")
    with pytest.raises(app.UsageError, match="--attention_block=0"):
        _config("--attention_block=0")

"""Repository paths for tests, and the XLA flags a test's child process gets."""

import os
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]


def xla_flags(devices: int) -> str:
    """This process's XLA_FLAGS (the Makefile's compile-speed flags among them) with ``devices`` fake CPU devices."""
    keep = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    return " ".join([*keep, f"--xla_force_host_platform_device_count={devices}"])

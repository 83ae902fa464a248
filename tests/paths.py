"""Repository paths for tests, and the XLA flags a test's child process gets."""

import os
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]


def xla_flags(devices: int) -> str:
    """This process's XLA_FLAGS (the Makefile's compile-speed flags among them) with ``devices`` fake CPU devices."""
    from launch.local import with_device_count

    return with_device_count(os.environ.get("XLA_FLAGS", ""), devices)

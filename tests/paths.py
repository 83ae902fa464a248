"""Repository paths for tests."""

import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]

"""orbax CheckpointManager wrapper: the train state plus a JSON record (step, data position, config).

A checkpoint is complete only once orbax has committed it (it writes to a temporary
directory and renames), so an interrupted save is never taken as a checkpoint.
"""

from __future__ import annotations

import os

import orbax.checkpoint as ocp


def committed_steps(workdir: str) -> list[int]:
    """The steps of the committed checkpoints in ``<workdir>/checkpoints`` (directories named by their step; orbax
    renames a save's temporary directory to that only once it is complete), ascending; without orbax, so that a
    failure path can read it while a save is in flight."""
    d = os.path.join(workdir, "checkpoints")
    return sorted(int(name) for name in os.listdir(d) if name.isdigit()) if os.path.isdir(d) else []


class Checkpointer:
    """Saves ``{"state": pytree, "meta": dict}`` under ``<workdir>/checkpoints/<step>``."""

    def __init__(self, workdir: str, keep: int):
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        self.manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep))

    def save(self, step: int, state, meta: dict) -> None:
        """Starts an asynchronous save (returns before the bytes are on disk)."""
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, step: int, like) -> tuple[object, dict]:
        """The state (shaped and placed like ``like``) and the meta record of ``step``."""
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(like),
                                                                 meta=ocp.args.JsonRestore()))
        return out["state"], out["meta"]

    def meta(self, step: int) -> dict:
        """The meta record of ``step`` alone (read before the state, to check the state can be read)."""
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

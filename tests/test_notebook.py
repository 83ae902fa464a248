"""notebooks/quickstart.ipynb: committed without outputs; runs headless, from another directory, in < 5 minutes."""

import json
import sys
import time

import nbformat
import pytest
from nbclient import NotebookClient

from tests.paths import REPO

NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"
BUDGET_S = 300


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code
    for cell in code:
        assert cell.outputs == [], cell.source[:80]
        assert cell.execution_count is None, cell.source[:80]


@pytest.mark.timing
def test_notebook_runs_headless(tmp_path, monkeypatch):
    # A kernel spec of this interpreter (the venv's python), first on JUPYTER_PATH: no other python3 kernel is used.
    spec = tmp_path / "jupyter" / "kernels" / "rollplex-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "rollplex test", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("ROLLPLEX_NOTEBOOK_OUT", str(tmp_path / "runs"))
    monkeypatch.delenv("ROLLPLEX_NOTEBOOK_STEPS", raising=False)  # the notebook's own 200 steps
    cwd = tmp_path / "elsewhere"  # the notebook finds the repo root itself
    cwd.mkdir()

    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell("import sys\nprint(sys.executable)"))
    client = NotebookClient(nb, kernel_name="rollplex-test", timeout=BUDGET_S, startup_timeout=120,
                            resources={"metadata": {"path": str(cwd)}})
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError (with the cell and traceback) if a cell fails
    elapsed = time.perf_counter() - t0
    assert elapsed < BUDGET_S, f"the notebook took {elapsed:.0f} s (budget {BUDGET_S} s)"

    assert nb.cells[0].outputs[0]["text"].strip() == sys.executable
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o["output_type"] == "error"]
    images = [o for o in outputs if o["output_type"] == "display_data" and "image/png" in o.get("data", {})]
    assert len(images) >= 3, f"expected the samples, reward and timeline figures (+ memory), got {len(images)}"
    memory_cell = nb.cells[-1]
    assert any("image/png" in o.get("data", {}) for o in memory_cell.outputs) or \
        "no memory/* metrics" in "".join(o.get("text", "") for o in memory_cell.outputs)
    runs = tmp_path / "runs"
    for name in ("serial/plots/reward.png", "serial/plots/timeline.png", "rollplex/plots/timeline.png",
                 "timeline_serial_vs_rollplex.png", "serial/run_summary.json", "rollplex/run_summary.json"):
        assert (runs / name).is_file(), name
    summary = json.loads((runs / "serial" / "run_summary.json").read_text())
    assert summary["steps_done"] == 204 and summary["eval/n"] == 64  # 200 serial steps, 4 more; eval_n=64
    # It learned (the 200 steps are paid for anyway). The notebook's settings (serial, synthetic_n=256, 200 + 4
    # steps) measured on seeds 0-5 (2026-12): first-10 reward mean 0.000-0.003, last-20 mean 0.50-0.87 (seed 0,
    # the notebook's: 0.87; seed 5 learned late, 0.19 greedy at step 150), greedy accuracy on the 64 held-out
    # images 0.95-1.00. A policy stuck on one colour scores ~0.25 greedy, on three of four ~0.75 (LEARNING.md).
    assert summary["reward/first10_mean"] <= 0.05, summary["reward/first10_mean"]  # it started from nothing
    assert summary["reward/last20_mean"] >= 0.3, summary["reward/last20_mean"]
    assert summary["eval/greedy_accuracy"] >= 0.8, summary["eval/greedy_accuracy"]

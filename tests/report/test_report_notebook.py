"""The analysis notebook runs end to end on a synthetic sweep and is committed without outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "alspec_analysis.ipynb"


def test_notebook_is_stripped() -> None:
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install nbformat)")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


@pytest.mark.slow
def test_notebook_executes(sweep_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install nbformat)")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install nbclient)")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed (pip install ipykernel)")
    monkeypatch.setenv("ALSPEC_OUTDIR", str(sweep_dir))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "\n".join(str(o.get("data", {}).get("text/markdown", "")) + o.get("text", "") for o in outputs)
    assert "0.250 / 42.0%" in text and "tok/s" in text
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 5  # score vs hit rate, two heatmaps, open loop, speedup vs score

"""Execute a notebook the way CI does: quick mode, results in a temporary directory."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def run_notebook(name: str, out: Path, monkeypatch) -> int:
    """Execute ``notebooks/<name>.ipynb`` in quick mode against ``out``; the number of images it showed."""
    monkeypatch.setenv("FLEXPAGE_NOTEBOOK_QUICK", "1")
    monkeypatch.setenv("FLEXPAGE_NOTEBOOK_OUT", str(out))
    notebook = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    NotebookClient(notebook, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), name
    return sum("image/png" in o.get("data", {}) for c in code for o in c.get("outputs", []))

"""Execute a result notebook against a results folder and save the executed copy (atomically).

    python run_notebook.py NOTEBOOK.ipynb RESULTS_DIR OUT.ipynb      # under Snakemake: rule notebook

The notebook runs in its own folder (so it imports notebooks/resultset.py) with LOWMEMBP_RESULTS=RESULTS_DIR.
"""

import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def execute(nb_path: str | Path, results: str | Path | None, out: str | Path | None = None, timeout: int = 600):
    nb_path = Path(nb_path).resolve()
    nb = nbformat.read(nb_path, as_version=4)
    old = os.environ.get("LOWMEMBP_RESULTS")
    if results is not None:
        os.environ["LOWMEMBP_RESULTS"] = str(Path(results).resolve())
    os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"  # figures kept as image/png outputs
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(nb_path.parent)}}).execute()
    finally:
        if results is not None:
            if old is None:
                os.environ.pop("LOWMEMBP_RESULTS", None)
            else:
                os.environ["LOWMEMBP_RESULTS"] = old
    if out is not None:
        from lowmembp.atomic import atomic_write

        atomic_write(out, nbformat.writes(nb))
    return nb


if "snakemake" in globals():
    sm = snakemake  # noqa: F821
    with open(sm.log[0], "w") as log:
        sys.stderr = log
        execute(sm.input.nb, sm.params.results, sm.output[0])
elif __name__ == "__main__":
    import by_hand  # this folder: sys.path[0] of a script run by path

    execute(*by_hand.arguments("python run_notebook.py NOTEBOOK.ipynb RESULTS_DIR OUT.ipynb", sys.argv[1:], 3))

# The result notebooks (notebooks/*.ipynb, listed in workflow/catalogue.py), executed against this run's results;
# executed copies under results/.


rule notebook:
    input:
        nb=Path(workflow.basedir) / "notebooks" / "{nb}.ipynb",
        tables=table_files("csv"),
        runs=[f"{R}/runs.csv"] if CELLS else [],
    output:
        cat.notebook_path(R, "{nb}"),
    log:
        f"{R}/logs/notebooks/{{nb}}.log",
    params:
        results=lambda wc, output: str(Path(output[0]).parents[1]),
    conda:
        "../envs/lowmembp.yaml"
    script:
        "../scripts/run_notebook.py"

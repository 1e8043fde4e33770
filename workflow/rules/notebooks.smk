# The result notebooks (notebooks/*.ipynb), executed against this run's results; executed copies under results/.


rule notebook:
    input:
        nb=Path(workflow.basedir) / "notebooks" / "{nb}.ipynb",
        tables=expand(f"{R}/tables/{{t}}.csv", t=table_names()),
        runs=[f"{R}/runs.csv"] if CELLS else [],
    output:
        f"{R}/notebooks/{{nb}}.ipynb",
    log:
        f"{R}/logs/notebooks/{{nb}}.log",
    params:
        results=lambda wc, output: str(Path(output[0]).parents[1]),
    conda:
        "../envs/lowmembp.yaml"
    script:
        "../scripts/run_notebook.py"

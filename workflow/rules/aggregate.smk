# All records of the configured sweep -> one CSV (one row per cell, oom and error cells included).


rule aggregate:
    input:
        records=record_paths(),
        schema=Path(workflow.basedir) / "experiments" / "record.schema.json",
    output:
        f"{R}/runs.csv",
    log:
        f"{R}/logs/aggregate.log",
    conda:
        "../envs/lowmembp.yaml"
    script:
        "../scripts/aggregate.py"

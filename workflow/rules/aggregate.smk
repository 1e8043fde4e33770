# All records of the configured sweep -> one CSV (one row per cell, oom and error cells included; a record that does
# not read back becomes an `invalid` row with its path and the reason).


rule aggregate:
    input:
        records=checked_record_paths,
    output:
        f"{R}/runs.csv",
    log:
        f"{R}/logs/aggregate.log",
    conda:
        "../envs/lowmembp.yaml"
    script:
        "../scripts/aggregate.py"

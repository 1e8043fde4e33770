# Refresh the small reference result set kept in git (results/reference/), which the notebooks fall back to on a
# fresh clone: `snakemake --cores 1 reference` after a default run. Not part of `all`.


rule reference:
    input:
        runs=f"{R}/runs.csv",
        tables=expand(f"{R}/tables/{{t}}.{{ext}}", t=table_names(), ext=["md", "csv"]),
        repro=expand(f"{R}/repro/{{name}}.csv", name=repro_names()),
        benchmarks=expand(f"{R}/benchmarks/repro/{{name}}.tsv", name=repro_names()),
    output:
        machine=f"{R}/reference/MACHINE.md",
        runs=f"{R}/reference/runs.csv",
    log:
        f"{R}/logs/reference.log",
    params:
        config=config,
    conda:
        "../envs/lowmembp.yaml"
    script:
        "../scripts/make_reference.py"

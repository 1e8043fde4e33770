# Refresh the small reference result set kept in git (results/reference/), which the notebooks fall back to on a
# fresh clone: `snakemake --cores 1 reference` after a default run. Not part of `all`. Every file it writes is an
# output below (make_reference.py copies input i to output i).
REF = f"{R}/reference"


rule reference:
    input:
        runs=f"{R}/runs.csv",
        tables=table_files("md") + table_files("csv") + [cat.table_paths(R, cat.HEADLINE.name)[e] for e in ("md", "csv")],
        repro=[cat.repro_csv(R, r.name) for r in reproductions()],
        benchmarks=[f"{R}/benchmarks/repro/{r.name}.tsv" for r in reproductions()],
    output:
        machine=f"{REF}/MACHINE.md",
        runs=f"{REF}/runs.csv",
        tables=[p.replace(f"{R}/", f"{REF}/", 1) for p in table_files("md") + table_files("csv")
                + [cat.table_paths(R, cat.HEADLINE.name)[e] for e in ("md", "csv")]],
        repro=[cat.repro_csv(REF, r.name) for r in reproductions()],
    log:
        f"{R}/logs/reference.log",
    params:
        config=config,
    conda:
        "../envs/lowmembp.yaml"
    script:
        "../scripts/make_reference.py"

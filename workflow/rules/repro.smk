# Paper-scale reproductions (experiments.repro, listed in workflow/catalogue.py): estimated on fake tensors on the CPU,
# one CSV each.


rule repro:
    output:
        cat.repro_csv(R, "{name}"),
    log:
        f"{R}/logs/repro/{{name}}.log",
    benchmark:
        f"{R}/benchmarks/repro/{{name}}.tsv"
    wildcard_constraints:
        name="|".join(r.name for r in cat.REPRODUCTIONS),
    params:
        options=lambda wc: config["repro"]["options"].get(wc.name, {}),
    threads: 1
    conda:
        "../envs/lowmembp.yaml"
    script:
        "../scripts/repro.py"

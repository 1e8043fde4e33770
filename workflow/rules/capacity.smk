# The planner's capacity table and figure: the largest batch that fits in 24 / 40 / 80 GiB per paper model and
# method (lowmembp.plan on fake tensors; no GPU). Settings: config `capacity:` (schema defaults; `models: {}` turns
# it off, as config/tiny.yaml does). BERT-large (TokenTune's model) and LLaMA-7B: 349 s on one core at load
# average ~10 (ViT-B/16 would add 333 s there).

import importlib.util as _imp

# the defaults are the script's (workflow/scripts/capacity.py DEFAULTS), read from it by path
_spec = _imp.spec_from_file_location("capacity_script", str(Path(workflow.basedir) / "workflow/scripts/capacity.py"))
_capacity_script = _imp.module_from_spec(_spec)
_spec.loader.exec_module(_capacity_script)
CAPACITY = config.setdefault("capacity", {})
for _key, _value in _capacity_script.DEFAULTS.items():
    CAPACITY.setdefault(_key, _value)


# in `rule all` (Snakefile)
CAPACITY_TARGETS = ([f"{R}/tables/capacity.md", f"{R}/tables/capacity.csv", f"{R}/figures/capacity.png"]
                    if CAPACITY["models"] else [])


rule capacity:
    output:
        csv=f"{R}/tables/capacity.csv",
        md=f"{R}/tables/capacity.md",
        png=report(f"{R}/figures/capacity.png", caption="../report/capacity.rst", category="Planner",
                   labels={"figure": "capacity"}),
    log:
        f"{R}/logs/capacity.log",
    benchmark:
        f"{R}/benchmarks/capacity.tsv"
    params:
        models=CAPACITY["models"],
        methods=CAPACITY["methods"],
        gpus=CAPACITY["gpus"],
    threads: 1
    conda:
        "../envs/lowmembp.yaml"
    script:
        "../scripts/capacity.py"


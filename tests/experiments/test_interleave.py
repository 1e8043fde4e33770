"""Several training-job cells in one process, timed in turns (experiments.interleave): a record per cell, the job's
own, with step times from the rounds and ratios to the first cell."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from experiments import interleave
from experiments.record import schema

TINY = ["--task", "cifar100", "--model", "vit-b16", "--batch-size", "2", "--dtype", "bf16", "--synthetic-data",
        "--layers", "1", "--synthetic-overrides", json.dumps({"img_size": 32, "embed_dim": 48, "num_heads": 2}),
        "--no-progress", "--steps", "100", "--threads", "1"]


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_cells_are_the_jobs_records_with_interleaved_times_and_ratios(tmp_path):
    cells = {"lora": TINY + ["--method", "lora"], "lowmembp": TINY + ["--method", "lora+lowmembp"],
             "liger": TINY + ["--method", "lora+liger"]}  # refused for a timm model: recorded, the others go on
    records, ratios = interleave.run_cells(cells, rounds=4, warmup_rounds=1, out_dir=tmp_path, progress=lambda m: 0)
    assert set(records) == set(cells) and set(ratios) == {"lora", "lowmembp"}
    for name in ("lora", "lowmembp"):
        rec = json.loads((tmp_path / f"{name}.json").read_text())
        jsonschema.validate(rec, schema())
        st = rec["step_time_s"]
        assert rec["status"] == "ok" and st["n"] == 4 and "interleaved with 1 other cells" in st["how"]
        assert st["ci95_low"] <= st["p50"] <= st["ci95_high"]
        assert rec["run"]["steps"] == 2 + 1 + 4  # the probes' steps, the untimed round, the timed rounds
        assert rec["peak"]["device"]["bytes"] > 0 and rec["saved_bytes"]["total"] > 0
    assert ratios["lora"]["median"] == 1.0
    assert records["liger"]["status"] == "error" and "liger" in records["liger"]["message"]


def test_a_cells_peak_leaves_out_what_the_cells_before_it_hold():
    sections = {"peak": {"device": {"bytes": 1000, "how": "cuda max_memory_allocated",
                                    "by_category": {"parameters": 100, "activations_and_temporaries": 700}}}}
    interleave._adjust_peak(sections, 600)
    dev = sections["peak"]["device"]
    assert dev["bytes"] == 400 and dev["by_category"]["activations_and_temporaries"] == 100
    assert "less 600 bytes allocated before this cell's build" in dev["how"]


def test_a_cell_that_fails_in_the_rounds_gets_its_record_and_the_others_go_on(tmp_path, monkeypatch):
    from experiments import train

    real_step = train.Run.step

    def step(self, step, forward):
        if self.cfg.method == "lora+lowmembp" and step == 3:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")
        return real_step(self, step, forward)

    monkeypatch.setattr(train.Run, "step", step)
    cells = {"lora": TINY + ["--method", "lora"], "lowmembp": TINY + ["--method", "lora+lowmembp"]}
    records, ratios = interleave.run_cells(cells, rounds=3, warmup_rounds=1, out_dir=tmp_path, progress=lambda m: 0)
    assert records["lowmembp"]["status"] == "oom" and "step 3" in records["lowmembp"]["message"]
    assert records["lora"]["status"] == "ok" and set(ratios) == {"lora"}
    assert json.loads((tmp_path / "lowmembp.json").read_text())["status"] == "oom"

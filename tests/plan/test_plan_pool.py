"""lowmembp.plan.pool: the planner's rows in worker processes. A method that fails alone drops every combination
holding it (not run, or run and left out; the progress total shrinks by those not run), combinations go
longest first, workers started from a fork server or forked from a fresh command-line process give the same rows,
and an unknown start method is refused."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lowmembp.plan import make_plan
from lowmembp.plan.pool import run_rows

pytestmark = pytest.mark.slow  # the full suite only: the planner's worker pool


def _stub(job: dict) -> dict:
    """A row for ``job`` without estimating anything: ``a`` fails alone; with ``job["dir"]``, only once the
    combinations holding it have run (on the other worker: they finish before ``a`` has failed)."""
    method, where = job["method"], job.get("dir")
    if where and "+" in method:
        (Path(where) / method).touch()
    if where and method == "a":
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all((Path(where) / m).exists() for m in ("a+b", "a+b+c", "a+c")):
            time.sleep(0.01)
    ok = method != "a"
    return {"method": method, "label": method, "status": "ok" if ok else "skipped",
            "reason": "" if ok else "ValueError: a cannot run here"}


class _Progress:
    def __init__(self):
        self.rows, self.totals = [], []

    def __call__(self, row):
        self.rows.append(row["method"])

    def set_total(self, n):
        self.totals.append(n)


@pytest.mark.parametrize("jobs,start", [(1, None), (2, "fork")])
def test_a_failing_method_drops_its_combinations(jobs, start, tmp_path):
    where = str(tmp_path) if jobs > 1 else None
    singles = [{"method": m, "dir": where} for m in ("baseline", "a", "b", "c")]
    multis = [{"method": m, "dir": where} for m in ("a+b", "b+c", "a+b+c", "b+c+d", "a+c")]
    progress = _Progress()
    rows, failed = run_rows(_stub, singles, multis, jobs=jobs, preload=[], start_method=start, progress=progress)
    assert failed == {"a": "ValueError: a cannot run here"}
    assert sorted(r["method"] for r in rows) == ["b", "b+c", "b+c+d", "baseline", "c"]
    assert len(progress.totals) == 1 and len(progress.rows) == progress.totals[0]  # the bar ends full
    if jobs == 1:  # one process: the order they ran in, combinations of the most methods first; the three
        #            combinations holding a are not run and no longer counted
        assert progress.rows == ["baseline", "a", "b", "c", "b+c+d", "b+c"] and progress.totals == [9 - 3]
    else:  # the other worker ran the combinations holding a before a failed: counted, then left out
        assert progress.totals == [9] and {"a+b", "a+b+c", "a+c"} <= set(progress.rows)


def test_an_unknown_start_method_is_refused():
    with pytest.raises(ValueError, match="start_method must be one of"):
        run_rows(_stub, [{"method": "baseline"}], [], jobs=2, preload=[], start_method="thread")


def test_workers_from_a_fork_server_and_forked_from_the_command_line_agree(tmp_path):
    """Two workers each way (a fork server from this process, which has run autograd; ``python -m lowmembp.plan``
    forks its own) give the rows one process gives."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 56,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 61,
        "max_position_embeddings": 64}))
    kw = dict(batch_size=2, seq_len=16, gpu_memory="4MiB", methods=["checkpointing", "lora"], reserved=0)
    keep = ("label", "status", "peak_bytes", "largest_batch", "flops", "rank")

    def rows(p):
        return [{k: r.get(k) for k in keep} for r in p]

    one = rows(make_plan(str(tmp_path), jobs=1, **kw).rows)
    served = rows(make_plan(str(tmp_path), jobs=2, start_method="forkserver", **kw).rows)
    cli = subprocess.run([sys.executable, "-m", "lowmembp.plan", "--model", str(tmp_path), "--batch-size", "2",
                          "--seq-len", "16", "--gpu-memory", "4MiB", "--methods", "checkpointing,lora", "--jobs", "2",
                          "--reserved", "0", "--json"], capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stderr
    forked = rows(json.loads(cli.stdout)["rows"])
    assert one == served == forked and len(one) == 4

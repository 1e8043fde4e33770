"""What the min-cut partitioner saves for backward in a compiled model, one row per saved tensor.

    rows = partitioner_saved(model, lambda: model(**batch).loss)
    # [{"graph": 0, "name": "mm_4", "module": "model.layers.0.mlp.gate_proj", "op": "aten.mm.default",
    #   "shape": (128, 172), "dtype": "float32", "bytes": 88064, "graph_input": "", "aliases": ...}, ...]
    python -m experiments.repro.partitioner_saved --family llama --method lowmembp --block 0   # one block, as a table
    python -m experiments.repro.partitioner_saved --family bert --method baseline --memory-budget 0.9

How: the model is compiled (``nn.Module.compile``, ``dynamic=False``) with a backend that is
``aot_eager_decomp_partition`` with its graphs recorded: AOT autograd with inductor's decompositions and the min-cut
partitioner of inductor (``min_cut_rematerialization_partition(compiler="inductor")``), no code generation — the
partitioning ``inductor`` does at the same ``activation_memory_budget`` (inductor's own graph passes can still move a
few tensors: on the small ViT of the README it saved 4–6 % more). ``forward`` runs once with a
backward (compiling both graphs). The saved values are the backward graph's inputs other than the incoming
gradients (``tangents_*``). A saved view or alias of another value is folded into the value it views (one storage:
the row keeps the base's name and counts its bytes once, ``aliases`` lists the views), as
:class:`lowmembp.measurement.saved.SavedTensorAccountant` counts one storage once. ``module`` is the module that made
the base
value (Dynamo's ``nn_module_stack``, the model's own qualified name), ``op`` the ATen op; graph inputs are named in
``graph_input`` (Dynamo's source, e.g. ``L['kwargs']['input_ids']``) and parameters / buffers are left out, as the
accountant leaves them out. ``tests/methods/test_compile_method.py`` checks the bytes against the accountant's.
"""
from __future__ import annotations

import argparse
import functools
import re
import sys

import torch
import torch.nn as nn

__all__ = ["partitioner_saved", "recording_backend"]


def recording_backend(store: dict):
    """A ``torch.compile`` backend (``aot_eager_decomp_partition`` semantics) that appends each Dynamo graph, its
    forward graph and its backward graph to ``store["dynamo"]``, ``store["forward"]`` and ``store["backward"]``."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from lowmembp._compat import aot_autograd, inductor_decompositions

    def keep(kind):
        def compiler(gm, example_inputs):
            store.setdefault(kind, []).append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    def backend(gm, example_inputs):
        store.setdefault("dynamo", []).append(gm)
        return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                            decompositions=inductor_decompositions(),
                            partition_fn=functools.partial(min_cut_rematerialization_partition,
                                                           compiler="inductor"))(gm, example_inputs)
    return backend


def _base(node):
    """The node a chain of view / alias ops starts from (one storage)."""
    while node.op == "call_function" and getattr(node.target, "is_view", False) and node.args \
            and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _module(node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = str(list(stack.values())[-1][0])
    # "L['args'][0].model.layers.0.mlp.gate_proj" / "L['self'].model..." -> "model.layers.0.mlp.gate_proj";
    # a wrapper's "__dict__['_modules']['base_model']" (peft) -> "base_model"
    path = re.sub(r"__dict__\['_modules'\]\['([^']+)'\]", r"\1", path)
    return re.sub(r"^L\['[a-z]+'\](\[\d+\])?\.?", "", path)


def _source(node) -> str:
    arg = node.meta.get("grapharg")
    src = getattr(arg, "source", None)
    return src.name if isinstance(getattr(src, "name", None), str) else (src.name() if src is not None else node.name)


def _is_param(source: str) -> bool:
    return "_parameters" in source or "_buffers" in source or "parameters[" in source


def partitioner_saved(model: nn.Module, forward, memory_budget: float | None = None) -> list[dict]:
    """Compile ``model`` in place with :func:`recording_backend`, run ``forward()`` (returns the loss) and its
    backward once, and return one row per storage the compiled forward saves for backward (see the module doc).
    ``memory_budget``: ``torch._functorch.config.activation_memory_budget`` while partitioning (None: torch's).
    Only this first call runs under it: a later call that recompiles (a guard fails; BERT's first call sets
    ``config.problem_type``) partitions at whatever budget is in force then."""
    from lowmembp._compat import functorch_config, reset_compiler

    store: dict = {}
    reset_compiler()
    model.compile(backend=recording_backend(store), dynamic=False)
    patch = {} if memory_budget is None else {"activation_memory_budget": float(memory_budget)}
    with functorch_config().patch(**patch):
        forward().backward()
    model.zero_grad(set_to_none=True)
    rows: list[dict] = []
    for g, (dyn, fw, bw) in enumerate(zip(store.get("dynamo", []), store.get("forward", []),
                                          store.get("backward", []))):
        sources = [_source(n) for n in dyn.graph.nodes if n.op == "placeholder"]
        fw_nodes = {n.name: n for n in fw.graph.nodes}
        by_base: dict[str, dict] = {}
        for p in bw.graph.nodes:
            if p.op != "placeholder" or p.name.startswith("tangents"):
                continue
            val = p.meta.get("val")
            if not isinstance(val, torch.Tensor):
                continue  # a saved SymInt / scalar: no storage
            base = _base(fw_nodes.get(p.name, p))
            if base.name in by_base:
                by_base[base.name]["aliases"].append(p.name)
                continue
            graph_input = ""
            if base.op == "placeholder":
                graph_input = sources[int(base.name.split("_")[-1]) - 1] if base.name.startswith("primals_") \
                    else base.name
                if _is_param(graph_input):
                    continue
            bval = base.meta.get("val", val)
            by_base[base.name] = {
                "graph": g, "name": base.name, "module": _module(base),
                "op": "" if base.op == "placeholder" else str(base.target), "shape": tuple(bval.shape),
                "dtype": str(bval.dtype).replace("torch.", ""), "bytes": bval.numel() * bval.element_size(),
                "graph_input": graph_input, "aliases": [] if p.name == base.name else [p.name]}
        rows.extend(by_base.values())
    return rows


def main(argv=None) -> int:
    from experiments.repro.compiled_saving import FAMILIES, build, convert

    ap = argparse.ArgumentParser(prog="python -m experiments.repro.partitioner_saved",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="llama", choices=FAMILIES)
    ap.add_argument("--method", default="lowmembp")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--block", type=int, default=None, help="only the rows of this block (modules '*.<i>.*')")
    ap.add_argument("--memory-budget", type=float, default=None,
                    help="torch's activation_memory_budget while partitioning, in [0, 1] (default: torch's, 1)")
    a = ap.parse_args(argv)
    from lowmembp.methods.registry import parse

    try:
        parse(a.method)
    except ValueError as err:
        ap.error(str(err))
    if a.memory_budget is not None and not 0 <= a.memory_budget <= 1:
        ap.error(f"--memory-budget must be in [0, 1], got {a.memory_budget}")
    model, forward = build(a.family, a.seq_len)
    model = convert(model, a.method)
    rows = partitioner_saved(model, lambda: forward(model), memory_budget=a.memory_budget)
    if a.block is not None:
        blocks = {m.group(1) for r in rows for m in [re.search(r"\.(\d+)(\.|$)", r["module"])] if m}
        rows = [r for r in rows if re.search(rf"\.{a.block}(\.|$)", r["module"])]
        if not rows:
            print(f"error: no saved tensor belongs to block {a.block}; the model's blocks: "
                  f"{', '.join(sorted(blocks, key=int)) or 'none'}", file=sys.stderr)
            return 1
    print("| module | op | shape | dtype | bytes | also saved as |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['module'] or r['graph_input']} | {r['op']} | {r['shape']} | {r['dtype']} | {r['bytes']} | "
              f"{', '.join(r['aliases'])} |")
    print(f"\ntotal {sum(r['bytes'] for r in rows)} bytes in {len(rows)} storages")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

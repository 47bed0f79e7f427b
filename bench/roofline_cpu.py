"""Roofline on our own CPU run: do the matmuls of a large model reach the measured matmul ceiling?

Run: ``.venv/bin/python bench/roofline_cpu.py [--model llama-3.2-1b] [--layers 1] [--seq 256]``.
Measures this machine's ceilings (``advisor.run.ceilings``, stored in a temporary run store), then
profiles a step of the model (proxy mode: ``--layers`` of its blocks, its full-width embedding and
head) in a child process under the same store, so the run's roofline is judged against the measured
roofs. Prints, per matmul shape with over a GFLOP a call, the achieved FLOP/s as a share of the
measured ceiling (a ratio of two measurements taken minutes apart in one session, on the same cores),
the time-weighted share over all of them, and the step's verdict. Run it on a quiet machine: another
process on the cores lowers the ceiling and the step alike, but not always equally.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from advisor.analysis.summary import analyze_path
from advisor.run.ceilings import measure_ceilings
from advisor.run.launcher import profile_run
from advisor.spec.options import RunOptions
from advisor.spec.setup import make_setup
from advisor.store.ceilings import run_ceilings, store_ceilings
from advisor.store.runstore import RunStore


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="roofline-cpu-") as tmp:
        store = RunStore(tmp)
        ceilings = measure_ceilings("cpu", ("fp32",), matmul_n=2048, repeats=5)
        store_ceilings(ceilings, store.root)
        ceiling = ceilings.matmul_flops_per_s["fp32"]
        print(
            f"measured ceilings: matmul fp32 {ceiling / 1e9:.1f} GFLOP/s, copy {ceilings.copy_bytes_per_s / 1e9:.1f} GB/s"
        )
        setup = make_setup(model=args.model, gpu="cpu", seq=args.seq, micro_batch=args.micro_batch, precision="fp32")
        run = profile_run(setup, RunOptions(device="cpu", steps=args.steps, layers=args.layers), store)
        if run.status != "ok":
            print(f"run {run.status}: {run.record.get('message')}")
            return 1
        report = analyze_path(run.path, ceilings=run_ceilings(run.path))
        table, m = report.tables["roofline"], report.metrics
        big = table[(table["category"] == "gemm") & (table["flops"] / table["calls"] > 1e9)]
        print(f"\n{args.model}, {args.layers} layer(s), seq {args.seq} x micro {args.micro_batch}, fp32 on the CPU")
        print(f"{'op':14s} {'shapes':44s} {'calls':>5s} {'ms/call':>9s} {'GFLOP/s':>8s} {'of ceiling':>10s}")
        for r in big.itertuples():
            share = r.achieved_flops_per_s / ceiling
            print(
                f"{r.op:14s} {r.input_dims[:44]:44s} {r.calls:5d} {r.mean_call_us / 1e3:9.2f} "
                f"{r.achieved_flops_per_s / 1e9:8.1f} {100 * share:9.1f} %"
            )
        weighted = (big["achieved_flops_per_s"] / ceiling * big["time_ms"]).sum() / big["time_ms"].sum()
        print(
            f"\nmatmuls over 1 GFLOP a call: {big['time_ms'].sum() / table['time_ms'].sum():.0%} of modelled op time, "
            f"at {100 * weighted:.1f} % of the measured ceiling (time-weighted)"
        )
        print(f"verdict: {m.roofline_bound}-bound; roofs: {m.roofline_roofs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The estimator's step time against published training runs whose every layout detail is known.

Run: ``.venv/bin/python bench/published_runs.py`` (instant: analytic). Prints a markdown table and
writes it to ``bench/results/published_runs.md`` (``--out -`` to skip). The runs and their sources are
in ``advisor/published.py``: Korthikanti et al. 2022, table 4, eight Megatron-LM iterations on DGX A100
80 GB, the same eight Calculon validates on (its mean error: 3.7 %), and torchtitan's Llama 3 8B and
70B on 64 A100 with FSDP2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from advisor.published import KORTHIKANTI, TORCHTITAN, compare_published  # noqa: E402 - needs ROOT on sys.path as a script

DEFAULT_OUT = ROOT / "bench" / "results" / "published_runs.md"


def _layout(setup) -> str:
    p, tr = setup.parallel, setup.train
    pp = f"PP{p.pp}" + (f"x{p.vpp}v" if p.vpp > 1 else "")
    return f"{setup.gpus} GPUs: TP{p.tp} {pp} DP{p.dp}, b{tr.micro_batch} x m{setup.grad_accum}"


def report() -> str:
    rows = compare_published()
    errors = [c.error_pct for c in rows]
    megatron = [c.error_pct for c in rows if c.run.source == KORTHIKANTI]
    lines = [
        "# Estimated against published step times",
        "",
        "- Command: `.venv/bin/python bench/published_runs.py` (analytic: no device, instant).",
        f"- Sources: {KORTHIKANTI}, GPT models at sequence 2048, vocabulary 51200, fp16, dropout 0.1,",
        "  Megatron's fused softmax (no flash attention), layouts as Calculon validates them",
        f"  (`calculon-ai/calculon`, `validation/*.json`); {TORCHTITAN}, tokens/s per GPU at local",
        "  batch 1, sequence 8192, bf16 (step = 8192 / tokens/s). Details in `advisor/published.py`.",
        '- Error: estimated / measured - 1 (negative: the estimate is too fast). "Measured MFU": our model',
        "  FLOPs over the measured time. Korthikanti's table 5 gives 41.5, 51.4, 56.0 and 56.3 % for the",
        "  selective runs and torchtitan 58.2 and 51.7 %, which count the embedding table as FLOPs (ours do",
        "  not: +5.2 % and +1.3 %): the FLOP count is right, what the estimate misses is time.",
        "",
        "| run | layout | measured s | estimated s | error | measured MFU | estimated MFU | GiB/GPU est. |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in rows:
        e = c.estimate
        lines.append(
            f"| {c.run.name} | {_layout(c.run.setup)} | {c.run.measured_step_s:.2f} | {c.estimated_step_s:.2f} "
            f"| {c.error_pct:+.1f} % | {c.measured_mfu_pct:.1f} % | {100 * e.mfu_frac:.1f} % "
            f"| {e.memory.total_bytes / 2**30:.1f} |"
        )
    lines += [
        "",
        f"Mean absolute error {statistics.mean(abs(x) for x in errors):.1f} % over all {len(errors)}, from "
        f"{min(errors):+.1f} % to {max(errors):+.1f} %, too fast on {sum(x < 0 for x in errors)}; on the "
        f"{len(megatron)} Megatron-LM steps {statistics.mean(abs(x) for x in megatron):.1f} % (Calculon: 3.7 %).",
        "",
        "Where it misses: the estimate takes every GEMM at 82 % of the A100's peak and every collective at",
        "80 % of the link, whatever its size; the measured A100 steps of both frameworks run up to 27 %",
        "longer. The smallest Megatron model misses most (22B on TP 8 alone, where a TP rank's GEMMs are",
        "8,192 x 6,144 x 768 to 3,072, likely below the sizes that reach that rate), and the selective runs",
        "miss more than the full-recompute ones. Calculon reaches 3.7 %",
        "with per-size GEMM and collective efficiency tables fitted to A100 measurements; this estimator's",
        '`calibrate` fits measured runs of the user\'s own machine instead (README, "How advice is made").',
        "",
        "Pipeline stages: 1F1B runs at its slowest stage's pace. Megatron-LM's even split leaves the output",
        "head on top of the last stage's blocks, and the estimate now counts it there; it spread the head",
        "evenly over the stages before. The six pipelined runs moved from -1.5 to -20.6 % (mean absolute",
        "12.2 %) to +1.2 to -19.1 % (9.4 %); the Megatron mean from 14.6 to 12.4 %. Stages need not",
        "divide the blocks either: Llama 3 405B trained its 126 blocks on 16 stages of 7, 8 x 14, 7, which",
        "now sizes as published (`tests/test_estimator.py`).",
        "",
        "Data-parallel collectives across nodes: with k GPUs of a node in the group, NCCL runs k rings,",
        "each crossing nodes on its own GPU's NIC, so FSDP over whole nodes reaches 8 NICs' bandwidth",
        "(capped by NVLink), not one. Before, torchtitan's 8B read 3.24 s (+17.5 %, too slow: 1.23 s of",
        "exposed gathers at one NIC's 25 GB/s) and 70B 35.0 s (+41.4 %); both now read too fast, as the",
        "Megatron runs do, because their compute alone is. Point-to-point rings (CP, PP), all-to-alls and",
        "tensor parallelism stay at one NIC (`estimator._group_bw`).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", default=str(DEFAULT_OUT), help="markdown file to write, '-' for none (default: %(default)s)"
    )
    args = ap.parse_args(argv)
    md = report()
    print(md)
    if args.out != "-":
        Path(args.out).write_text(md, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

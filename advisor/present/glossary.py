"""The terms the app and its report use, said once: the glossary popover, the report's last section,
and the tooltips of the tables' column headers."""

from __future__ import annotations

GLOSSARY: dict[str, str] = {
    "MFU": "Model FLOPs utilisation: the model's FLOPs per second (6N + attention per token, recompute not "
    "counted; PaLM, appendix B) over the devices' peak dense FLOP/s. 40-60 % is good for large training.",
    "HFU": "Hardware FLOPs utilisation: as MFU, but counting the FLOPs actually executed, recompute included.",
    "Step time": "One optimizer step: every micro-batch's forward and backward, the gradient reduction and the "
    "optimizer update. Estimates are analytic; measured ones are the mean of the profiled steps.",
    "Bubble": "Pipeline bubble: time a pipeline stage idles while the pipeline fills and drains, (p-1)/m of "
    "the step for p stages and m micro-batches, (p-1)/(v m) with v virtual stages.",
    "Exposed": "Communication (or a copy) not hidden behind computation: the part of its time that adds to the "
    "step, because no compute kernel ran beside it.",
    "ZeRO stage": "How the data-parallel ranks share model state (Rajbhandari et al. 2019): 0 none (DDP), 1 "
    "optimizer states, 2 also gradients, 3 also weights (FSDP's full sharding).",
    "TP / PP / DP / CP / EP": "Tensor, pipeline, data, context and expert parallel degrees: "
    "dp = GPUs / (tp x pp x cp).",
    "Recompute": "Activation checkpointing: activations are dropped in the forward and recomputed in the "
    "backward, trading compute for memory. Selective recomputes only the attention core.",
    "Roofline": "Achieved FLOP/s against arithmetic intensity (FLOP per byte moved): below the slanted roof an "
    "op is memory-bound, below the flat one compute-bound. Headroom: the share of its time above the roof.",
    "Predicted gain": "What a recommendation is estimated to save, from the estimator (and the regression "
    "calibrated on this machine's runs, where there is one); Verify measures it by re-running.",
}
"""Each term and what it means here."""

COLUMN_TIPS: dict[str, str] = {
    "GiB": "gibibytes (2^30 bytes) per GPU",
    "share %": "this row's share of the total, 0 to 100",
    "ms": "milliseconds per optimizer step",
    "MFU %": GLOSSARY["MFU"],
    "mfu_pct": GLOSSARY["MFU"],
    "tokens/s": "tokens processed per second over all GPUs",
    "tokens_per_s": "tokens processed per second over all GPUs",
    "step ms": "time of one optimizer step, estimated, in ms",
    "step_time_ms": "measured: mean time of the profiled steps, in ms",
    "estimate_step_time_ms": "the estimator's step time for the run's setup, in ms",
    "peak_memory_gib": "highest memory allocated during the profiled steps, GiB",
    "memory GiB": "estimated memory per GPU, GiB",
    "memory %": "estimated memory per GPU over the device's capacity, 0 to 100",
    "self ms": "time in the op itself, without the ops it calls, per profiled run",
    "total ms": "time in the op and the ops it calls",
    "GFLOP": "billions of floating-point operations counted for the op",
    "time ms": "time over the trace, in ms",
    "ms over trace": "time summed over the whole trace (every profiled step and rank), in ms",
    "time_ms": "time over the trace, in ms",
    "exposed_ms": GLOSSARY["Exposed"],
    "headroom %": "the share of the op's time above its roof: what a kernel at the roof would save",
    "bound": "memory-bound or compute-bound, by where the op sits against the roofs",
    "achieved GFLOP/s": "FLOPs per second the op reached",
    "roof GFLOP/s": "the most FLOPs per second the device allows at the op's intensity",
    "FLOP/byte": "arithmetic intensity: FLOPs per byte moved to and from memory",
    "predicted gain %": GLOSSARY["Predicted gain"],
    "estimator says": "the analytic estimator's value after the change",
    "calibrated says": "the value after the change as the regression fitted on this machine's runs corrects it",
    "baseline spread %": "step-to-step spread of the run before the change: a smaller measured gain is noise",
    "change_pct": "B against A, in % of A",
}
"""Tooltips of the tables' column headers, by the header's text."""

UNIT_TIPS: dict[str, str] = {
    "_ns": "nanoseconds",
    "_us": "microseconds",
    "_ms": "milliseconds",
    "_s": "seconds",
    "_pct": "percent, 0 to 100",
    "_frac": "a fraction, 0 to 1",
    "_count": "a count",
    "_bytes": "bytes",
    "_mib": "mebibytes (2^20 bytes)",
    "_gib": "gibibytes (2^30 bytes)",
    "_gbps": "GB/s (10^9 bytes per second)",
    "_flops": "floating-point operations",
    "_w": "watts",
    "_mhz": "megahertz",
    " ms": "milliseconds",
    " us": "microseconds",
    " %": "percent, 0 to 100",
    " GiB": "gibibytes (2^30 bytes)",
    " MiB": "mebibytes (2^20 bytes)",
    " GB/s": "GB/s (10^9 bytes per second)",
    " GFLOP/s": "10^9 floating-point operations per second",
}
"""The unit a column header's ending names (the house style puts the unit in every column name): a
header COLUMN_TIPS does not know gets "<header>: in <unit>" from its longest matching ending."""

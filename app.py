"""The web app (Gradio). Thin: widgets to values, one core call, results to plots and tables.

Run ``python app.py`` (binds 127.0.0.1:7860; set ADVISOR_HOST / ADVISOR_PORT to change).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr
import pandas as pd

from advisor.analysis.roofline import trace_roofline
from advisor.analysis.summary import analyze, format_report, load_trace
from advisor.errors import AdvisorError
from advisor.estimate.estimator import estimate
from advisor.present.charts import (
    category_figure,
    measured_memory_figure,
    memory_figure,
    nvml_figure,
    phase_figure,
    plan_scatter_figure,
    roofline_figure,
    temporal_figure,
    time_figure,
    timeline_figure,
)
from advisor.present.report import (
    describe_setup,
    fmt_duration,
    memory_rows,
    mfu_note,
    offload_line,
    roofline_line,
    step_band,
    time_rows,
    verdict,
)
from advisor.run.launcher import local_device_type, profile_run
from advisor.spec.options import RunOptions
from advisor.spec.presets import HARDWARE, MODELS, fastest_precision, local_hardware
from advisor.spec.setup import make_setup
from advisor.spec.specs import (
    FP8_RECIPES,
    FRAMEWORKS,
    OFFLOAD_MODES,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    PRECISIONS,
    RECOMPUTE_MODES,
)
from advisor.store.runstore import RunInfo, RunStore

log = logging.getLogger("advisor.app")

DEFAULTS = {
    "model": "llama-3.1-8b",
    "gpu": "h200",
    "gpus": 8,
    "seq": 8192,
    "micro_batch": 1,
    "global_batch": 64,
    "precision": "bf16",
    "optimizer": "adamw",
    "optimizer_impl": "fused",
    "framework": "megatron",
    "recompute": "none",
    "flash_attention": True,
    "fp32_grads": True,
    "recompute_layers": 0,
    "offload_activations": 0,
    "compile": False,
    "fused_loss": False,
    "tp": 1,
    "pp": 1,
    "vpp": 1,
    "cp": 1,
    "ep": 1,
    "zero": 1,
    "sequence_parallel": False,
    "offload": "none",
}
SIZE_KEYS = ["model", "config_file", *list(DEFAULTS)[1:]]
"""The Size tab's inputs in the order of size_view's parameters (the /size endpoint's)."""
_DEGREES = [1, 2, 4, 8, 16, 32, 64]
_EMPTY_MEMORY = pd.DataFrame(columns=["component", "GiB", "share %"])
_EMPTY_TIME = pd.DataFrame(columns=["component", "ms", "share %"])


def size_view(
    model: str,
    config_file: str | None,
    gpu: str,
    gpus: float,
    seq: float,
    micro_batch: float,
    global_batch: float,
    precision: str,
    optimizer: str,
    optimizer_impl: str,
    framework: str,
    recompute: str,
    flash_attention: bool,
    fp32_grads: bool,
    recompute_layers: float,
    offload_activations: float,
    compile: bool,
    fused_loss: bool,
    tp: int,
    pp: int,
    vpp: int,
    cp: int,
    ep: int,
    zero: int,
    sequence_parallel: bool,
    offload: str,
):
    """Size tab: (verdict markdown, memory figure, time figure, memory table, time table)."""
    try:
        setup = _setup_from_size_inputs(
            model, config_file, gpu, gpus, seq, micro_batch, global_batch, precision, optimizer, optimizer_impl,
            framework, recompute, flash_attention, fp32_grads, recompute_layers, offload_activations, compile,
            fused_loss, tp, pp, vpp, cp, ep, zero, sequence_parallel, offload,
        )  # fmt: skip
        est = estimate(setup)
    except AdvisorError as err:
        return f"### Invalid setup\n{err}", None, None, _EMPTY_MEMORY, _EMPTY_TIME
    except Exception:  # the server stays up; the log keeps the traceback
        log.exception("size_view failed")
        return (
            "### Internal error\nThe estimate failed unexpectedly; see the server log.",
            None,
            None,
            _EMPTY_MEMORY,
            _EMPTY_TIME,
        )
    icon = "⚠️" if est.tight else "✅" if est.fits else "❌"
    band = f" {step_band(est)}" if step_band(est) else ""
    summary = (
        f"### {icon} {verdict(est)}\n"
        f"**{est.tokens_per_s:,.0f} tokens/s**{band} · step {fmt_duration(est.step_time_ms)}{band} · "
        f"**MFU {100 * est.mfu_frac:.1f} %**{band} · {est.setup.gpus} GPUs (dp {est.setup.parallel.dp})\n\n"
        f"<small>{describe_setup(est)}</small>"
    )
    if note := mfu_note(est):
        summary += f"\n\n<small>{note}</small>"
    mem = pd.DataFrame(memory_rows(est), columns=["component", "GiB", "share %"]).round(2)
    tim = pd.DataFrame(time_rows(est), columns=["component", "ms", "share %"]).round(1)
    return summary, memory_figure(est), time_figure(est), mem, tim


def _as_int(value: float | None) -> int | None:
    """Gradio numbers arrive as float or None; integral floats become ints, the rest stay for the
    spec's validation to reject with a clear message."""
    if value is None:
        return None
    return int(value) if float(value).is_integer() else value  # type: ignore[return-value]


def _degree_dropdown(choices: list[int], value: int, label: str, **kwargs) -> gr.Dropdown:
    """A parallel degree as text choices: gradio_client documents dropdown values as strings, and
    _as_int turns them back into integers (an integer from a Python caller works too)."""
    return gr.Dropdown([str(c) for c in choices], value=str(value), label=label, **kwargs)


def _block_count(value: int, label: str, *, info: str | None = None, elem_id: str | None = None) -> gr.Number:
    """A count of transformer blocks (recompute or offload N blocks a stage), as the Size and Profile
    tabs both ask for it."""
    return gr.Number(value=value, precision=0, minimum=0, label=label, info=info, elem_id=elem_id)


def build_size_tab() -> tuple[dict, list]:
    """The Size tab: its input widgets by SIZE_KEYS name, and its outputs."""
    d = DEFAULTS
    with gr.Row():
        with gr.Column(scale=1, min_width=320):
            gr.Markdown("#### Model and devices")
            model = gr.Dropdown(list(MODELS), value=d["model"], label="Model preset", elem_id="size-model")
            config_file = gr.File(label="…or a Hugging Face config.json", file_types=[".json"], type="filepath")
            with gr.Row():
                gpu = gr.Dropdown(list(HARDWARE), value=d["gpu"], label="Device")
                gpus = gr.Number(
                    value=d["gpus"], precision=0, minimum=1, label="GPUs", info="empty: tp x pp x cp x ep, one replica"
                )
            gr.Markdown("#### Training step")
            with gr.Row():
                seq = gr.Number(value=d["seq"], precision=0, minimum=1, label="Sequence length")
                micro_batch = gr.Number(value=d["micro_batch"], precision=0, minimum=1, label="Micro-batch")
                global_batch = gr.Number(
                    value=d["global_batch"], precision=0, minimum=0, label="Global batch (0 = no accum)"
                )
            precision = gr.Radio(list(PRECISIONS), value=d["precision"], label="Precision")
            with gr.Row():
                optimizer = gr.Radio(list(OPTIMIZERS), value=d["optimizer"], label="Optimizer")
                optimizer_impl = gr.Radio(list(OPTIMIZER_IMPLS), value=d["optimizer_impl"], label="Optimizer kernels")
            framework = gr.Radio(
                list(FRAMEWORKS),
                value=d["framework"],
                label="Implementation",
                info="megatron: bf16 weights + fp32 master, grad buffers; pytorch: eager autocast over fp32 weights",
            )
            recompute = gr.Radio(
                list(RECOMPUTE_MODES),
                value=d["recompute"],
                label="Activation checkpointing",
                info="selective: Megatron's (attention core); selective-op: torchtitan's (every other matmul kept)",
            )
            with gr.Row():
                recompute_layers = _block_count(
                    d["recompute_layers"],
                    "Blocks that recompute per stage",
                    info="with full: 0 = all (Megatron's recompute_num_layers)",
                )
                offload_activations = _block_count(
                    d["offload_activations"], "Blocks' activations offloaded", info="per stage, to host memory and back"
                )
            with gr.Row():
                flash = gr.Checkbox(value=d["flash_attention"], label="Flash attention")
                fp32_grads = gr.Checkbox(value=d["fp32_grads"], label="fp32 gradients (Megatron default)")
            with gr.Row():
                compile_box = gr.Checkbox(value=d["compile"], label="torch.compile (eager step)")
                fused_loss = gr.Checkbox(value=d["fused_loss"], label="Fused loss (eager step)")
            gr.Markdown("#### Parallelism (dp = GPUs / (tp·pp·cp))")
            with gr.Row():
                tp = _degree_dropdown(_DEGREES, d["tp"], "TP")
                pp = _degree_dropdown(_DEGREES, d["pp"], "PP")
                vpp = _degree_dropdown([1, 2, 3, 4, 6, 8], d["vpp"], "Virtual stages")
            with gr.Row():
                cp = _degree_dropdown(_DEGREES, d["cp"], "CP")
                ep = _degree_dropdown(_DEGREES, d["ep"], "EP")
                zero = _degree_dropdown([0, 1, 2, 3], d["zero"], "ZeRO / FSDP stage", elem_id="size-zero")
            sp = gr.Checkbox(value=d["sequence_parallel"], label="Sequence parallel (with TP)")
            offload = gr.Radio(list(OFFLOAD_MODES), value=d["offload"], label="CPU offload")
        with gr.Column(scale=2):
            summary = gr.Markdown(elem_id="size-verdict")
            with gr.Row():
                mem_plot = gr.Plot(label="Memory per GPU")
                time_plot = gr.Plot(label="Step time")
            with gr.Row():
                mem_table = gr.Dataframe(_EMPTY_MEMORY, label="Memory breakdown", interactive=False, wrap=True)
                time_table = gr.Dataframe(_EMPTY_TIME, label="Step-time breakdown", interactive=False, wrap=True)
    widgets = {"model": model, "config_file": config_file, "gpu": gpu, "gpus": gpus, "seq": seq}
    widgets |= {"micro_batch": micro_batch, "global_batch": global_batch, "precision": precision}
    widgets |= {"optimizer": optimizer, "optimizer_impl": optimizer_impl, "framework": framework}
    widgets |= {"recompute": recompute, "flash_attention": flash, "fp32_grads": fp32_grads}
    widgets |= {"recompute_layers": recompute_layers, "offload_activations": offload_activations}
    widgets |= {"compile": compile_box, "fused_loss": fused_loss}
    widgets |= {"tp": tp, "pp": pp, "vpp": vpp, "cp": cp, "ep": ep, "zero": zero, "sequence_parallel": sp}
    widgets["offload"] = offload
    inputs = [widgets[k] for k in SIZE_KEYS]
    outputs = [summary, mem_plot, time_plot, mem_table, time_table]
    gr.on(
        triggers=[c.change for c in inputs],
        fn=size_view,
        inputs=inputs,
        outputs=outputs,
        api_name="size",
        show_progress="hidden",
    )
    return widgets, outputs


# --- Profile tab ---------------------------------------------------------------------------------

PROFILE_DEFAULTS = {
    "model": "tiny",
    "seq": 256,
    "micro_batch": 2,
    "global_batch": 0,
    # This machine's fast path: bf16 on a GPU (a V100 user picks fp16: reading the GPU's name here would
    # start CUDA in the UI process), on a CPU its fastest, fp32 without AVX512-BF16 or AMX (1/30 of fp32).
    "precision": "bf16" if local_device_type("auto") == "cuda" else fastest_precision(local_hardware("cpu")),
    "recompute": "none",
    "optimizer": "adamw",
    "offload": False,
    "device": "auto",
    "steps": 3,
    "layers": 0,
    "num_workers": 0,
    "pin_memory": False,
    "compile_model": False,
    "optimizer_impl": "foreach",
    "nproc": 1,
    "tp": 1,
    "pp": 1,
    "zero": 0,
    "sequence_parallel": False,
    "recompute_layers": 0,
    "offload_activations": 0,
    "fp8_recipe": "tensorwise",
    "unified_memory": False,
}
"""The Profile tab's inputs, in profile_view's parameter order; nproc > 1 runs the step under torchrun
with the layout dp = nproc / (tp x pp), ZeRO 0 = DDP, 1-2 = FSDP2 without and 3 with resharding.
recompute_layers: with full checkpointing, only that many blocks recompute (0: all); offload_activations:
that many blocks' saved activations go to host memory and back; fp8 runs torchao's float8 linears with
fp8_recipe's scaling; unified_memory runs the step's CUDA tensors from managed memory."""


class Jobs:
    """The long jobs in flight, one per (kind, browser session), each with its own cancel Event: a
    Cancel reaches only the caller's own job, never another user's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[tuple[str, str], threading.Event] = {}

    @staticmethod
    def _key(kind: str, request: gr.Request | None) -> tuple[str, str]:
        return kind, getattr(request, "session_hash", None) or "local"

    def start(self, kind: str, request: gr.Request | None) -> threading.Event:
        """A fresh cancel Event for the caller's new job of this kind."""
        event = threading.Event()
        with self._lock:
            self._events[self._key(kind, request)] = event
        return event

    def finish(self, kind: str, request: gr.Request | None, event: threading.Event) -> None:
        with self._lock:
            if self._events.get(self._key(kind, request)) is event:
                del self._events[self._key(kind, request)]

    def cancel(self, kind: str, request: gr.Request | None) -> bool:
        """Cancel the caller's running job of this kind; False when it has none."""
        with self._lock:
            event = self._events.get(self._key(kind, request))
        if event is None:
            return False
        event.set()
        return True


JOBS = Jobs()
_TOP_OPS_COLUMNS = ["op", "calls", "self ms", "total ms", "GFLOP"]
_ROOFLINE_LABEL = "Roofline: achieved FLOP/s against FLOP/byte (log-log; marker area: time)"


def _store() -> RunStore:
    return RunStore()


def _no_run_outputs():
    return None, None, None, None, pd.DataFrame(columns=_TOP_OPS_COLUMNS), None, None


def _timeline(table):
    """The step-timeline figure of an event table's last step on rank 0; None where it has none
    (a trace with no events) or it fails (logged: the rest of the view still shows)."""
    from advisor.analysis.timeline import step_timeline

    try:
        return timeline_figure(step_timeline(table))
    except AdvisorError:
        return None
    except Exception:
        log.exception("step timeline failed")
        return None


def _roofline(path: str, table):
    """(Roofline, "") of the trace at ``path`` whose event table is ``table``, or (None, why) where it
    cannot be made; the rest of a view still shows. Our own runs are judged against the measured
    ceilings stored for their device where there are any (as ``advisor.analysis.summary.analyze_path`` does),
    uploads against the datasheet."""
    try:
        return trace_roofline(path, table, ceilings="auto" if table.attrs.get("own_run") else None), ""
    except AdvisorError as err:
        return None, f"Roofline skipped: {err}"
    except Exception:
        log.exception("roofline failed")
        return None, "Roofline skipped: it failed unexpectedly; see the server log."


@functools.lru_cache(maxsize=32)
def _run_trace_figures(run_dir: str, trace_mtime_ns: int):
    """(step-timeline figure, roofline figure) of a stored run, its trace parsed once per file version
    (every page load opens the newest run); None for each that cannot be made. The run folder, not
    its trace file, so its last step counts as complete and a distributed run gives rank 0."""
    if not trace_mtime_ns:
        return None, None
    try:
        table = load_trace(run_dir)
    except AdvisorError:  # an unreadable trace: the run's own numbers still show
        return None, None
    roofline, _ = _roofline(run_dir, table)
    return _timeline(table), roofline_figure(roofline.table) if roofline else None


def run_view(run: RunInfo):
    """(summary markdown, phase figure, memory figure, NVML figure, step-timeline figure, top-ops
    table, trace file, roofline figure) of a run; outputs added later come last, so an API caller's
    positions keep their meaning."""
    rec = run.record
    m = run.metrics()
    head = f"### Run `{run.run_id}`: {rec['status']}"
    if rec.get("message"):
        head += f"\n{rec['message']}"
    if m is None:
        return (head, *_no_run_outputs())
    nv = m.get("nvml") or {}
    nv_line = (
        f"NVML: {nv.get('gpu_util_pct_mean', 0):.0f} % util, {nv.get('power_w_mean', 0):.0f} W"
        if nv.get("nvml_available")
        else nv.get("nvml_reason", "NVML unavailable")
    )
    summary = (
        f"{head}\n**{m['step_time_ms']:.1f} ms per step** (estimate {m['estimate_step_time_ms']:.1f} ms) · "
        f"**{m['tokens_per_s']:,.0f} tokens/s** · MFU {100 * m['mfu_frac']:.1f} % · peak memory "
        f"{m['peak_memory_bytes'] / 2**30:.3f} GiB on {m['device_name']}\n\n"
        f"{m['model_name']}: seq {m['seq_len']} x micro {m['micro_batch']} x accum {m['grad_accum']}, "
        f"{m['precision']}, recompute {m['recompute']}, {m['optimizer']} · {nv_line}"
    )
    if m.get("roofline_bound"):
        line = roofline_line(m)
        summary += f"\n\n{line[0].upper()}{line[1:]}"
    if m.get("proxy_note"):
        summary += f"\n\n**{m['proxy_note']}**"
    if off := m.get("activation_offload"):
        line = offload_line(off)
        summary += f"\n\n{line[0].upper()}{line[1:]}"
    if f8 := m.get("fp8"):
        summary += f"\n\nfp8: {f8['backend']} ({f8['recipe']} scaling), {f8['linears']} linears in fp8"
    if um := m.get("unified_memory"):
        summary += (
            f"\n\nUnified Memory: peak {um.get('peak_bytes', 0) / 2**30:.3f} GiB managed in "
            f"{um.get('allocations', 0)} segments (cap {um['budget']['cap_bytes'] / 2**30:.1f} GiB: "
            f"{um['budget']['why']}); {um.get('refused_allocations', 0)} refused by the cap. {um['page_faults']}"
        )
    if (m.get("world_size") or 1) > 1:
        mems = ", ".join(f"{b / 2**30:.3f}" for b in m["rank_peak_memory_bytes"])
        steps = ", ".join(f"{t:.1f}" for t in m["rank_step_time_ms"])
        skew = m.get("step_skew_pct")
        summary += (
            f"\n\n**{m['world_size']} processes: {m['layout']}.** Peak memory by rank (GiB): {mems}; "
            f"step by rank (ms): {steps}" + ("" if skew is None else f"; the slowest rank is {skew:.1f} % behind")
        )
    summary += f"\n\nWith Nsight Systems:\n```\n{rec.get('nsys_command', '')}\n```"
    top_file = run.path / "top_ops.json"
    rows = json.loads(top_file.read_text(encoding="utf-8")) if top_file.is_file() else []
    key = "self_device_us" if m["device_type"] == "cuda" else "self_cpu_us"
    top = pd.DataFrame(
        [(r["name"], r["calls"], r[key] / 1e3, r["cpu_total_us"] / 1e3, (r["flops"] or 0) / 1e9) for r in rows[:15]],
        columns=_TOP_OPS_COLUMNS,
    ).round(3)
    nvml_file = run.path / "nvml.json"
    samples = json.loads(nvml_file.read_text(encoding="utf-8"))["samples"] if nvml_file.is_file() else []
    trace = run.path / "trace.json.gz"
    if not trace.is_file():  # a distributed run: one trace per rank, rank 0's offered for download
        trace = run.path / "ranks" / "rank-0.trace.json.gz"
    timeline, roofline = _run_trace_figures(str(run.path), trace.stat().st_mtime_ns if trace.is_file() else 0)
    figures = (phase_figure(m), measured_memory_figure(m), nvml_figure(samples), timeline)
    return (summary, *figures, top, str(trace) if trace.is_file() else None, roofline)


def profile_view(
    model: str,
    seq: float,
    micro_batch: float,
    global_batch: float,
    precision: str,
    recompute: str,
    optimizer: str,
    offload: bool,
    device: str,
    steps: float,
    layers: float,
    num_workers: float,
    pin_memory: bool,
    compile_model: bool,
    optimizer_impl: str,
    nproc: float = 1,
    tp: int | str = 1,
    pp: int | str = 1,
    zero: int | str = 0,
    sequence_parallel: bool = False,
    recompute_layers: float = 0,
    offload_activations: float = 0,
    fp8_recipe: str = "tensorwise",
    unified_memory: bool = False,
    request: gr.Request | None = None,
):
    """Profile tab: runs the step in a child process (nproc > 1: torchrun with that many), yields
    progress, then the run's view."""
    try:
        n = _as_int(nproc) or 1
        single_offload = bool(offload) and n == 1  # one process: ZeRO-Offload; several: FSDP2's offload
        setup = make_setup(
            model=model,
            # A placeholder the run replaces with this machine's device; fp8 on a CPU must reach the
            # run, which files it as refused with the reason (a CPU preset has no fp8 math to validate).
            gpu="cpu" if device == "cpu" and precision != "fp8" else "h100",
            gpus=n,
            tp=_as_int(tp),
            pp=_as_int(pp),
            zero=1 if single_offload else _as_int(zero),
            sequence_parallel=bool(sequence_parallel),
            seq=_as_int(seq),
            micro_batch=_as_int(micro_batch),
            global_batch=_as_int(global_batch) or 0,
            precision=precision,
            recompute=recompute,
            recompute_layers=_as_int(recompute_layers) or 0,
            offload_activations=_as_int(offload_activations) or 0,
            fp8_recipe=fp8_recipe,
            optimizer=optimizer,
            optimizer_impl=optimizer_impl,
            framework="pytorch",
            offload="optimizer" if offload else "none",
        )
        options = RunOptions(
            device=device,
            nproc=n,
            steps=_as_int(steps),
            layers=_as_int(layers) or 0,
            num_workers=_as_int(num_workers) or 0,
            pin_memory=bool(pin_memory),
            compile=bool(compile_model),
            unified_memory=bool(unified_memory),
        )
    except AdvisorError as err:
        yield (f"### Invalid setup\n{err}", *_no_run_outputs())
        return
    yield ("### Starting the child process…", *_no_run_outputs())
    result = yield from _in_background(
        "profile",
        request,
        lambda on_progress, cancel: profile_run(setup, options, _store(), on_progress=on_progress, cancel=cancel),
        lambda done, total, message: (
            f"### Running: {message} ({100 * done // total} %)",
            *(gr.skip() for _ in _no_run_outputs()),
        ),
    )
    if isinstance(result, str):
        yield (f"### Not run\n{result}", *_no_run_outputs())
        return
    yield run_view(result)


def _in_background(kind: str, request: gr.Request | None, job, progress_view):
    """Run ``job(on_progress, cancel)`` in a thread as the caller's job of this ``kind`` (its Cancel
    button sets ``cancel``: see Jobs), yielding ``progress_view(done, total, message)`` for each
    progress report; returns the job's result, or a message where it raised (an AdvisorError's own,
    or a short one for a crash, whose traceback goes to the log). The server never sees the raise.
    If the page goes away (Gradio stops the generator), the job is cancelled and waited for, so the
    device is free before the next queued job starts."""
    updates: queue.Queue = queue.Queue()
    result: dict = {}

    cancel = JOBS.start(kind, request)

    def work() -> None:
        try:
            result["value"] = job(lambda *p: updates.put(p), cancel)
        except AdvisorError as err:
            result["value"] = str(err)
        except Exception:
            log.exception("background job failed")
            result["value"] = "Internal error: the job failed unexpectedly; see the server log."
        finally:
            updates.put(None)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        while (item := updates.get()) is not None:
            yield progress_view(*item)
    except GeneratorExit:
        cancel.set()
        thread.join()
        raise
    finally:
        JOBS.finish(kind, request, cancel)
    return result["value"]


def _cancel(kind: str, request: gr.Request | None, cancelling: str, nothing: str) -> str:
    """What a Cancel button shows: ``cancelling`` when the caller has a job of this kind running."""
    return cancelling if JOBS.cancel(kind, request) else nothing


def cancel_profile(request: gr.Request | None = None) -> str:
    return _cancel("profile", request, "### Cancelling…", "Nothing of yours is running here to cancel.")


def open_run(run_id: str | None):
    """Show a stored run chosen in the list."""
    if not run_id:
        return ("Pick a run.", *_no_run_outputs())
    try:
        return run_view(_store().load(run_id))
    except AdvisorError as err:
        return (f"### Cannot open run\n{err}", *_no_run_outputs())
    except Exception:
        log.exception("open_run failed")
        return ("### Internal error\nThe run could not be shown; see the server log.", *_no_run_outputs())


def _run_dropdown(label: str, **kwargs) -> gr.Dropdown:
    """A stored-run picker. Its choices are filled per browser session on page load, so without a custom
    value an API caller (who never loads the page) or a run profiled after the load would be refused
    as "not in the list of choices"; the handlers validate every run id against the store instead."""
    return gr.Dropdown(choices=[], label=label, interactive=True, allow_custom_value=True, **kwargs)


def run_choices(index: int = 0, measured: bool = True) -> gr.Dropdown:
    """The stored runs, newest first, with the ``index``-th newest selected (0: the tab opens on the
    latest run; 1 on the History tab's run A, so A and B start as the two latest). ``measured``: count
    only runs that finished ok (where there are enough), so a tab does not open on a cancelled or
    failed run with nothing to show ("has no trace", "cannot compare")."""
    runs, _ = _store().list_runs()
    ids = [r.run_id for r in runs]
    # Measured runs first, newest first, then the others: the index-th differs for every index.
    pool = (
        [r.run_id for r in runs if r.status == "ok"] + [r.run_id for r in runs if r.status != "ok"] if measured else ids
    )
    return gr.Dropdown(choices=ids, value=pool[index] if len(pool) > index else None)


def picker_after_profile(summary: str | None):
    """The stored-run picker after a Profile click: on the run the summary shows (the one just made,
    whatever its status), else only its choices refreshed, so a refusal's message ("### Not run") is
    not replaced by another run's view through the picker's change."""
    runs, _ = _store().list_runs()
    ids = [r.run_id for r in runs]
    made = next((i for i in ids if f"`{i}`" in (summary or "")), None)
    return gr.Dropdown(choices=ids, value=made) if made else gr.update(choices=ids)


def build_profile_tab() -> tuple[dict, gr.Dropdown]:
    """The Profile tab: its input widgets by PROFILE_DEFAULTS name, and its stored-run picker."""
    d = PROFILE_DEFAULTS
    with gr.Row():
        with gr.Column(scale=1, min_width=320):
            model = gr.Dropdown(list(MODELS), value=d["model"], label="Model preset")
            with gr.Row():
                seq = gr.Number(value=d["seq"], precision=0, minimum=1, label="Sequence length")
                micro_batch = gr.Number(value=d["micro_batch"], precision=0, minimum=1, label="Micro-batch")
                global_batch = gr.Number(value=d["global_batch"], precision=0, minimum=0, label="Global batch")
            with gr.Row():
                precision = gr.Radio(list(PRECISIONS), value=d["precision"], label="Precision")
                fp8_recipe = gr.Radio(
                    list(FP8_RECIPES),
                    value=d["fp8_recipe"],
                    label="fp8 scaling (torchao)",
                    elem_id="profile-fp8-recipe",
                )
            recompute = gr.Radio(
                list(RECOMPUTE_MODES),
                value=d["recompute"],
                label="Activation checkpointing",
                elem_id="profile-recompute",
            )
            with gr.Row():
                precompute_layers = _block_count(
                    d["recompute_layers"], "Blocks that recompute (full; 0 = all)", elem_id="profile-recompute-layers"
                )
                poffload_acts = _block_count(
                    d["offload_activations"],
                    "Blocks' activations offloaded to host",
                    elem_id="profile-offload-activations",
                )
            unified_memory = gr.Checkbox(
                value=d["unified_memory"],
                label="Unified Memory (CUDA managed; capped at free GPU memory on PCIe GPUs)",
                elem_id="profile-unified-memory",
            )
            with gr.Row():
                optimizer = gr.Radio(list(OPTIMIZERS), value=d["optimizer"], label="Optimizer")
                optimizer_impl = gr.Radio(list(OPTIMIZER_IMPLS), value=d["optimizer_impl"], label="Optimizer kernels")
            with gr.Row():
                offload = gr.Checkbox(value=d["offload"], label="Offload optimizer to host (GPU only)")
                compile_model = gr.Checkbox(value=d["compile_model"], label="torch.compile")
            with gr.Row():
                device = gr.Radio(["auto", "cpu", "cuda"], value=d["device"], label="Device")
                steps = gr.Number(value=d["steps"], precision=0, minimum=1, maximum=100, label="Steps")
                layers = gr.Number(value=d["layers"], precision=0, minimum=0, label="Proxy layers (0 = all)")
            with gr.Row():
                num_workers = gr.Number(value=d["num_workers"], precision=0, minimum=0, label="DataLoader workers")
                pin_memory = gr.Checkbox(value=d["pin_memory"], label="pin_memory")
            with gr.Accordion("Distributed (torchrun: gloo on the CPU, NCCL on GPUs)", open=False):
                with gr.Row():
                    nproc = gr.Number(
                        value=d["nproc"], precision=0, minimum=1, maximum=64, label="Processes", elem_id="profile-nproc"
                    )
                    ptp = _degree_dropdown([1, 2, 4, 8], d["tp"], "TP")
                    ppp = _degree_dropdown([1, 2, 4, 8], d["pp"], "PP")
                    pzero = _degree_dropdown([0, 1, 2, 3], d["zero"], "ZeRO / FSDP2", elem_id="profile-zero")
                psp = gr.Checkbox(value=d["sequence_parallel"], label="Sequence parallel (with TP)")
                gr.Markdown(
                    "<small>dp = processes / (tp x pp); ZeRO 0 is DDP, 1-2 FSDP2 without resharding, 3 with. "
                    "Several nodes: the CLI's `--nnodes --rdzv-endpoint --rdzv-id` (README).</small>"
                )
            with gr.Row():
                run_btn = gr.Button("Run profiled step", variant="primary", elem_id="profile-run")
                cancel_btn = gr.Button("Cancel")
            with gr.Row():
                runs = _run_dropdown("Stored runs")
                refresh = gr.Button("Refresh list", size="sm")
        with gr.Column(scale=2):
            summary = gr.Markdown("Press **Run profiled step**, or open a stored run.", elem_id="profile-summary")
            with gr.Row():
                phases = gr.Plot(label="Step phases")
                memory = gr.Plot(label="Peak memory")
            nvml = gr.Plot(label="NVML")
            timeline = gr.Plot(label="One step: phases and top ops or kernels")
            roofline = gr.Plot(label=_ROOFLINE_LABEL, elem_id="profile-roofline")
            top_ops = gr.Dataframe(
                pd.DataFrame(columns=_TOP_OPS_COLUMNS),
                label="Top ops by self time",
                interactive=False,
                wrap=True,
                column_widths=["52%", "12%", "12%", "12%", "12%"],
                elem_id="profile-top-ops",
            )
            trace = gr.File(label="Chrome trace (open in ui.perfetto.dev)", interactive=False)
    widgets = {"model": model, "seq": seq, "micro_batch": micro_batch, "global_batch": global_batch}
    widgets |= {"precision": precision, "recompute": recompute, "optimizer": optimizer, "offload": offload}
    widgets |= {"device": device, "steps": steps, "layers": layers, "num_workers": num_workers}
    widgets |= {"pin_memory": pin_memory, "compile_model": compile_model, "optimizer_impl": optimizer_impl}
    widgets |= {"nproc": nproc, "tp": ptp, "pp": ppp, "zero": pzero, "sequence_parallel": psp}
    widgets |= {"recompute_layers": precompute_layers, "offload_activations": poffload_acts}
    widgets |= {"fp8_recipe": fp8_recipe, "unified_memory": unified_memory}
    inputs = [widgets[k] for k in PROFILE_DEFAULTS]  # profile_view's parameter order
    outputs = [summary, phases, memory, nvml, timeline, top_ops, trace, roofline]
    run_btn.click(profile_view, inputs, outputs, api_name="profile", concurrency_limit=1, concurrency_id="device").then(
        picker_after_profile, summary, runs, api_visibility="undocumented"
    )
    cancel_btn.click(cancel_profile, None, summary, api_visibility="undocumented", queue=False)
    runs.change(open_run, runs, outputs, api_name="open_run")
    refresh.click(run_choices, None, runs, api_visibility="undocumented")
    return widgets, runs


# --- Analyze tab ---------------------------------------------------------------------------------

MAX_UPLOAD = "500mb"
_TABLE_COLUMNS = ["name", "category", "time ms", "count", "share %"]


_COLLECTIVE_COLUMNS = ["rank", "kind", "calls", "time_ms", "exposed_ms"]
# The roofline table as shown: (column of advisor.analysis.roofline.ROOFLINE_COLUMNS, header, scale, decimals).
# The verdict and its numbers come right after the name, in view beside it; what identifies the row
# further (op, shapes) and how it was judged follow.
_ROOFLINE_SHOWN = [
    ("name", "name", None, None),
    ("bound", "bound", None, None),
    ("time_ms", "time ms", 1, 3),
    ("headroom_frac", "headroom %", 100, 1),
    ("achieved_flops_per_s", "achieved GFLOP/s", 1e-9, 2),
    ("roof_flops_per_s", "roof GFLOP/s", 1e-9, 2),
    ("achieved_bytes_per_s", "achieved GB/s", 1e-9, 2),
    ("intensity_flops_per_byte", "FLOP/byte", 1, 2),
    ("calls", "calls", 1, 0),
    ("mean_call_us", "us per call", 1, 1),
    ("op", "op", None, None),
    ("input_dims", "input shapes", None, None),
    ("precision", "precision", None, None),
    ("basis", "basis", None, None),
]
_ROOFLINE_HEADERS = [header for _, header, _, _ in _ROOFLINE_SHOWN]
_ROOFLINE_ROWS = 30
_NAME_CHARS = 90  # C++ template names run to pages


def _no_analysis():
    return (
        None,
        None,
        None,
        pd.DataFrame(columns=_TABLE_COLUMNS),
        pd.DataFrame(),
        pd.DataFrame(columns=_COLLECTIVE_COLUMNS),
        None,
        pd.DataFrame(columns=_ROOFLINE_HEADERS),
    )


def _roofline_rows(table: pd.DataFrame) -> pd.DataFrame:
    """The roofline table's rows with the most time, in units for reading (headers carry them)."""
    top = table.sort_values("time_ms", ascending=False, kind="stable").head(_ROOFLINE_ROWS)
    shown = {}
    for column, header, scale, decimals in _ROOFLINE_SHOWN:
        values = top[column]
        shown[header] = (
            values.astype(str).str.slice(0, _NAME_CHARS) if scale is None else (values * scale).round(decimals)
        ).to_numpy()
    return pd.DataFrame(shown)


class _Cancelled(AdvisorError):
    """The user cancelled the job between two of its stages."""


def analyze_view(
    upload: str | None,
    run_id: str | None,
    on_stage=None,
    cancel: threading.Event | None = None,
):
    """Analyze tab: (summary, temporal figure, category figure, step-timeline figure, top table,
    details table, collectives table, roofline figure, roofline table) of an uploaded trace, or else of
    a stored run's trace; outputs added later come last. ``on_stage(done, total, message)`` hears of
    each stage; a set ``cancel`` stops before the next one."""

    def stage(done: int, message: str) -> None:
        if cancel is not None and cancel.is_set():
            raise _Cancelled("cancelled by the user")
        if on_stage is not None:
            on_stage(done, 3, message)

    try:
        if upload:
            path, label = upload, os.path.basename(upload)
        elif run_id:
            path, label = str(_store().path(run_id)), run_id
        else:
            return (
                "Upload a trace (Kineto .json / .json.gz, a .zip of rank files, or an nsys .sqlite) or pick a run.",
                *_no_analysis(),
            )
        stage(0, f"loading {label}")
        table = load_trace(path)
        stage(1, f"analyzing {len(table):,} events")
        roofline, skipped = _roofline(path, table)
        report = analyze(table, run_id=label, roofline=roofline)
        stage(2, "drawing")
    except _Cancelled:
        return ("### Analysis cancelled", *_no_analysis())
    except AdvisorError as err:
        return (f"### Cannot analyze this trace\n{err}", *_no_analysis())
    except Exception:
        log.exception("analyze_view failed")
        return ("### Internal error\nThe analysis failed unexpectedly; see the server log.", *_no_analysis())
    t = report.tables
    gpu = not t["temporal_breakdown"].empty
    summary = "```\n" + format_report(report, label) + "\n```" + (f"\n\n{skipped}" if skipped else "")
    if gpu:
        top = t["top_kernels"].assign(time_ms=lambda d: d["time_ns"] / 1e6)
        top = top[["name", "category", "time_ms", "count", "time_pct"]]
    else:
        ops = t["top_ops"]
        top = pd.DataFrame(
            {
                "name": ops["name"],
                "category": "cpu op",
                "time_ms": ops["time_ns"] / 1e6,
                "count": ops["count"],
                "time_pct": [op["share_pct"] for op in report.metrics.top_ops],
            }
        )
    top.columns = _TABLE_COLUMNS
    top["name"] = top["name"].astype(str).str.slice(0, _NAME_CHARS)
    details = _in_ms(t["idle_time_breakdown"]) if gpu else t["phases"]
    return (
        summary,
        temporal_figure(t["temporal_breakdown"]) if gpu else None,
        category_figure(t["kernel_categories"]) if gpu else None,
        _timeline(table),
        top.round(3),
        details.round(3),
        t["collectives"][_COLLECTIVE_COLUMNS].round(3),
        roofline_figure(roofline.table) if roofline else None,
        _roofline_rows(roofline.table) if roofline else pd.DataFrame(columns=_ROOFLINE_HEADERS),
    )


def _in_ms(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with its ``*_ns`` columns in milliseconds (``*_ms``), as every other time in the app."""
    ns = [c for c in table.columns if str(c).endswith("_ns")]
    out = table.copy()
    for c in ns:
        out[c] = out[c] / 1e6
    return out.rename(columns={c: c[:-3] + "_ms" for c in ns})


def analyze_job(upload: str | None, run_id: str | None, request: gr.Request | None = None):
    """The Analyze tab's action: analyze_view in the background, its stages shown as they pass, and
    cancellable (the stage in progress finishes, the next does not start)."""
    result = yield from _in_background(
        "analyze",
        request,
        lambda on_stage, cancel: analyze_view(upload, run_id, on_stage, cancel),
        lambda done, total, message: (
            f"### Analyzing: {message} ({done} of {total} stages done)",
            *(gr.skip() for _ in _no_analysis()),
        ),
    )
    yield result if isinstance(result, tuple) else (f"### Cannot analyze this trace\n{result}", *_no_analysis())


def cancel_analysis(request: gr.Request | None = None) -> str:
    return _cancel(
        "analyze",
        request,
        "### Cancelling after the stage in progress…",
        "No analysis of yours is running here to cancel.",
    )


def build_analyze_tab() -> gr.Dropdown:
    with gr.Row():
        with gr.Column(scale=1, min_width=300):
            upload = gr.File(
                label="Trace: Kineto .json/.json.gz, .zip of rank files, or nsys .sqlite",
                file_types=[".json", ".gz", ".zip", ".sqlite"],
                type="filepath",
                elem_id="analyze-upload",
            )
            runs = _run_dropdown("…or a stored run")
            with gr.Row():
                button = gr.Button("Analyze", variant="primary", elem_id="analyze-run")
                cancel = gr.Button("Cancel")
        with gr.Column(scale=2):
            summary = gr.Markdown("Upload a trace or pick a run.", elem_id="analyze-summary")
            with gr.Row():
                temporal = gr.Plot(label="GPU time per rank")
                categories = gr.Plot(label="Kernel categories")
            timeline = gr.Plot(label="One step on rank 0: phases and top kernels or ops")
            top = gr.Dataframe(
                pd.DataFrame(columns=_TABLE_COLUMNS),
                label="Top kernels / ops",
                interactive=False,
                wrap=True,
                column_widths=["56%", "14%", "10%", "10%", "10%"],  # the numbers stay in view beside long names
                elem_id="analyze-top",
            )
            roofline = gr.Plot(label=_ROOFLINE_LABEL, elem_id="analyze-roofline")
            roofline_table = gr.Dataframe(
                pd.DataFrame(columns=_ROOFLINE_HEADERS),
                label=f"Roofline per op / kernel and shapes (top {_ROOFLINE_ROWS} by time; headroom: the share "
                "of its time above the roof)",
                interactive=False,
                wrap=True,
                max_chars=40,  # a click on a cell shows the rest; the numbers stay in view beside the names
                pinned_columns=1,
                elem_id="analyze-roofline-table",
            )
            details = gr.Dataframe(
                pd.DataFrame(), label="Idle time by stream (GPU) / step phases (CPU)", interactive=False, wrap=True
            )
            collectives = gr.Dataframe(
                pd.DataFrame(columns=_COLLECTIVE_COLUMNS),
                label="Collectives per rank: time, and exposed time with no compute beside it",
                interactive=False,
                wrap=True,
                elem_id="analyze-collectives",
            )
    outputs = [summary, temporal, categories, timeline, top, details, collectives, roofline, roofline_table]
    button.click(analyze_job, [upload, runs], outputs, api_name="analyze")
    upload.upload(analyze_job, [upload, runs], outputs, api_visibility="undocumented")
    cancel.click(cancel_analysis, None, summary, queue=False, api_visibility="undocumented")
    return runs


# --- Advice tab ----------------------------------------------------------------------------------

_ADVICE_COLUMNS = [
    "#",
    "severity",
    "rule",
    "recommendation",
    "predicted gain %",
    "on",
    "before",
    "after",
    "estimator says",
    "calibrated says",
    "basis",
]
_VERIFY_COLUMNS = [
    "rule",
    "on",
    "before",
    "predicted",
    "measured",
    "predicted gain %",
    "measured gain %",
    "baseline spread %",
    "baseline run",
    "re-run",
]


def _report_root() -> str:
    """One folder per app process for downloadable reports; reports older than an hour are removed."""
    root = os.path.join(tempfile.gettempdir(), f"advisor-reports-{os.getpid()}")
    os.makedirs(root, exist_ok=True)
    cutoff = time.time() - 3600
    for entry in os.scandir(root):
        if entry.is_dir() and entry.stat().st_mtime < cutoff:
            shutil.rmtree(entry.path, ignore_errors=True)
    return root


def _no_advice():
    return pd.DataFrame(columns=_ADVICE_COLUMNS), "", None, None


def _advice_rows(advice) -> pd.DataFrame:
    from advisor.advice.advise import TARGET_LABELS, fmt_value

    rows = []
    for i, r in enumerate(advice.recommendations, 1):
        g = r.gain
        rows.append(
            [
                i,
                r.rule.severity,
                r.rule.id,
                r.rule.title,
                None if g is None else round(g.gain_pct, 1),
                TARGET_LABELS[r.rule.target],
                "" if g is None else fmt_value(g.target, g.before),
                "" if g is None else fmt_value(g.target, g.after),
                "" if g is None or g.analytic_after is None else fmt_value(g.target, g.analytic_after),
                "" if g is None or g.calibrated_after is None else fmt_value(g.target, g.calibrated_after),
                r.action_note if g is None else g.basis + (" (upper bound)" if g.upper_bound else ""),
            ]
        )
    return pd.DataFrame(rows, columns=_ADVICE_COLUMNS)


def advice_view(source: str, run_id: str | None, upload: str | None, *size_inputs):
    """Advice tab: (summary, ranked table, full report markdown, report files, Advice) for a stored
    run, an uploaded trace, or the setup on the Size tab. The Advice goes to a session State (which
    the API does not return), for Apply."""
    from advisor.advice.advise import advice_markdown, advise, advise_run, advise_trace, gain_phrase

    try:
        if source == "stored run":
            if not run_id:
                return ("Pick a stored run (profile one on the Profile tab).", *_no_advice())
            advice = advise_run(run_id, _store())
        elif source == "uploaded trace":
            if not upload:
                return ("Upload a trace (Kineto JSON / gzip / zip of ranks, or nsys SQLite).", *_no_advice())
            advice = advise_trace(upload)
        else:
            advice = advise(setup=_setup_from_size_inputs(*size_inputs), source="the Size tab's setup")
    except AdvisorError as err:
        return (f"### Cannot advise\n{err}", *_no_advice())
    except Exception:
        log.exception("advice_view failed")
        return ("### Internal error\nThe advice failed unexpectedly; see the server log.", *_no_advice())
    md = advice_markdown(advice)
    out_dir = tempfile.mkdtemp(prefix="advice-", dir=_report_root())
    md_path = os.path.join(out_dir, "advice.md")
    json_path = os.path.join(out_dir, "advice.json")
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(md)
    with open(json_path, "w", encoding="utf-8") as f:
        f.write(advice.to_json())
    n = len(advice.recommendations)
    if n:
        top = advice.recommendations[0]
        g = top.gain
        gain = f" (predicted: {gain_phrase(g.target, g.gain_pct)})" if g else ""
        summary = f"### {n} recommendation{'s' * (n > 1)} for {advice.source}\nTop: **{top.rule.title}**{gain}."
    else:
        summary = f"### Nothing to recommend for {advice.source}\nNo rule fired on this input."
    summary += f"\n\n<small>{advice.n_rules} rules; {len(advice.not_applicable)} lacked their input.</small>"
    return summary, _advice_rows(advice), md, [md_path, json_path], advice


def _apply_label(i: int, rec) -> str:
    return f"#{i} {rec.rule.id}: {rec.rule.title}"


def apply_choices(advice) -> gr.Dropdown:
    """The last advice's recommendations that change the setup, the first one selected."""
    labels = []
    if advice is not None:
        labels = [_apply_label(i, r) for i, r in enumerate(advice.recommendations, 1) if r.after is not None]
    return gr.Dropdown(choices=labels, value=labels[0] if labels else None)


def apply_recommendation(advice, choice: str | None, source: str):
    """(message, Size tab values, Profile tab values, rule id) that load a recommendation's change into
    the shared spec. Values are keyed like DEFAULTS / PROFILE_DEFAULTS; empty dicts change nothing."""
    from advisor.advice.advise import fmt_value, gain_phrase

    if advice is None:
        return "Press **Advise** first.", {}, {}, None
    picked = [r for i, r in enumerate(advice.recommendations, 1) if _apply_label(i, r) == choice]
    if not picked:
        return "Pick a recommendation to apply (one that changes the setup).", {}, {}, None
    rec = picked[0]
    if rec.after is None:
        return f"`{rec.rule.id}` has no change to apply here: {rec.action_note or 'advice only'}", {}, {}, None
    change = ", ".join(f"`{k} = {v}`" for k, v in rec.changes.items())
    msg = f"### Applied {rec.rule.title}\n{change} is now the current setup on the Size, Profile and Plan tabs."
    if rec.gain is not None:
        g = rec.gain
        msg += (
            f" Predicted: {fmt_value(g.target, g.before)} → {fmt_value(g.target, g.after)} "
            f"({gain_phrase(g.target, g.gain_pct)})."
        )
    if source == "stored run":
        msg += " Press **Re-run with the recommendation applied** to measure it on this machine."
        profile = profile_values(rec.after, rec.options_after)
    else:
        msg += " The Size tab shows its estimate; press **Advise** again for what to do next."
        profile = profile_values(rec.after, None)
    # Only a stored run can be re-run with the rule: its id goes to the re-run box, else None clears it
    # (a rule of the Size tab's setup left there failed the next run's re-run: "did not fire").
    return msg, size_values(rec.after), profile, rec.rule.id if source == "stored run" else None


def verify_view(run_id: str | None, rule_id: str | None, progress=gr.Progress()):  # noqa: B008 (Gradio injects it)
    """Re-run a stored run with a recommendation applied: (message, predicted vs measured table)."""
    from advisor.advice.advise import TARGET_LABELS, fmt_value, gain_phrase
    from advisor.advice.verify import verify

    empty = pd.DataFrame(columns=_VERIFY_COLUMNS)
    if not run_id:
        return "Verification re-runs a stored run: pick one first.", empty
    try:
        rule_id = (rule_id or "").strip() or None
        v = verify(run_id, rule_id, _store(), on_progress=lambda d, t, m: progress((d, t), desc=m))
    except AdvisorError as err:
        return f"### Cannot verify\n{err}", empty
    except Exception:
        log.exception("verify_view failed")
        return "### Internal error\nThe re-run failed unexpectedly; see the server log.", empty
    row = [
        v.rule_id,
        v.target.replace("_", " "),
        fmt_value(v.target, v.before),
        fmt_value(v.target, v.predicted_after),
        fmt_value(v.target, v.measured_after),
        round(v.predicted_gain_pct, 1),
        round(v.measured_gain_pct, 1),
        v.new_run_id,
    ]
    row[-1:-1] = [None if v.noise_pct is None else round(v.noise_pct, 1), v.baseline_run_id or "(stored run)"]
    if v.noise_pct is not None and abs(v.measured_gain_pct) <= v.noise_pct:
        verdict_ = f"within the baseline's step-to-step spread of {v.noise_pct:.0f} %"
    else:
        verdict_ = "improved" if v.measured_gain_pct > 0 else "did NOT improve"
    change = ", ".join(f"`{k} = {val}`" for k, val in v.changes.items())
    label = TARGET_LABELS.get(v.target, v.target.replace("_", " "))
    msg = f"### Re-ran with {change}: {label} {verdict_} (measured {gain_phrase(v.target, v.measured_gain_pct)})"
    if v.baseline_run_id and v.stored_before is not None:
        msg += (
            f"\nBefore is the original setup re-run just now, side by side with the change: "
            f"{fmt_value(v.target, v.before)} (the stored run measured {fmt_value(v.target, v.stored_before)})."
        )
    return msg, pd.DataFrame([row], columns=_VERIFY_COLUMNS)


def _setup_from_size_inputs(*values):
    """The Setup of the Size tab's widgets, in SIZE_KEYS order."""
    kw = dict(zip(SIZE_KEYS, values, strict=True))
    return make_setup(
        model=kw["model"],
        hf_config=kw.pop("config_file") or None,
        gpu=kw["gpu"],
        gpus=_as_int(kw["gpus"]),
        seq=_as_int(kw["seq"]),
        micro_batch=_as_int(kw["micro_batch"]),
        global_batch=_as_int(kw["global_batch"]),
        precision=kw["precision"],
        optimizer=kw["optimizer"],
        optimizer_impl=kw["optimizer_impl"],
        framework=kw["framework"],
        recompute=kw["recompute"],
        flash_attention=bool(kw["flash_attention"]),
        fp32_grads=bool(kw["fp32_grads"]),
        recompute_layers=_as_int(kw["recompute_layers"]),
        offload_activations=_as_int(kw["offload_activations"]),
        compile=bool(kw["compile"]),
        fused_loss=bool(kw["fused_loss"]),
        tp=_as_int(kw["tp"]),
        pp=_as_int(kw["pp"]),
        vpp=_as_int(kw["vpp"]),
        cp=_as_int(kw["cp"]),
        ep=_as_int(kw["ep"]),
        zero=_as_int(kw["zero"]),
        sequence_parallel=bool(kw["sequence_parallel"]),
        offload=kw["offload"],
    )


def build_advice_tab(size_inputs: list) -> dict:
    """The Advice tab; returns its parts by name for the app to wire across tabs."""
    with gr.Row():
        with gr.Column(scale=1, min_width=300):
            source = gr.Radio(
                ["stored run", "uploaded trace", "Size tab setup"],
                value="Size tab setup",
                label="Advise on",
                elem_id="advice-source",
            )
            runs = _run_dropdown("Stored run", elem_id="advice-run-choice")
            upload = gr.File(
                label="Trace: Kineto .json/.json.gz, .zip of rank files, or nsys .sqlite",
                file_types=[".json", ".gz", ".zip", ".sqlite"],
                type="filepath",
            )
            button = gr.Button("Advise", variant="primary", elem_id="advice-run")
            gr.Markdown("#### Apply a recommendation")
            apply_choice = gr.Dropdown(choices=[], label="Recommendation", elem_id="advice-apply-choice")
            apply_btn = gr.Button("Apply to the current setup", elem_id="advice-apply")
            gr.Markdown("#### Verify by re-running (stored runs)")
            rule = gr.Textbox(label="Rule id (empty: the top one that can re-run here)", max_lines=1)
            verify_btn = gr.Button("Re-run with the recommendation applied", elem_id="advice-verify")
        with gr.Column(scale=2):
            summary = gr.Markdown("Pick what to advise on and press Advise.", elem_id="advice-summary")
            table = gr.Dataframe(pd.DataFrame(columns=_ADVICE_COLUMNS), label="Recommendations", interactive=False)
            apply_msg = gr.Markdown(elem_id="advice-apply-result")
            verify_msg = gr.Markdown(elem_id="advice-verify-result")
            verify_table = gr.Dataframe(
                pd.DataFrame(columns=_VERIFY_COLUMNS), label="Predicted vs measured", interactive=False
            )
            files = gr.File(label="Report (Markdown, JSON)", file_count="multiple", interactive=False)
            with gr.Accordion("Full report", open=False):
                report = gr.Markdown()
    state = gr.State(None)
    advise_inputs = [source, runs, upload, *size_inputs]
    button.click(advice_view, advise_inputs, [summary, table, report, files, state], api_name="advise").then(
        apply_choices, state, apply_choice, api_visibility="undocumented"
    ).then(lambda: "", None, rule, api_visibility="undocumented")  # a new advice: no rule carried over
    verify_btn.click(
        verify_view,
        [runs, rule],
        [verify_msg, verify_table],
        api_name="verify",
        concurrency_limit=1,
        concurrency_id="device",
    )
    parts = {"runs": runs, "source": source, "state": state, "apply_choice": apply_choice, "apply": apply_btn}
    parts |= {"apply_msg": apply_msg, "rule": rule, "advise_inputs": advise_inputs}
    parts["outputs"] = [summary, table, report, files, state]
    return parts


def wire_apply(advice: dict, size: dict, profile: dict, plan: dict) -> None:
    """Apply on the Advice tab: the recommendation's setup goes to every tab's widgets (the Size tab
    re-estimates on the change) and its rule id to the re-run box."""
    size_keys = [k for k in SIZE_KEYS if k != "config_file"]
    plan_keys = list(plan)
    outputs = [advice["apply_msg"], advice["rule"]]
    outputs += [size[k] for k in size_keys] + [profile[k] for k in PROFILE_DEFAULTS] + [plan[k] for k in plan_keys]

    def on_apply(state, choice, source):
        msg, size_vals, profile_vals, rule_id = apply_recommendation(state, choice, source)
        values = [msg, rule_id or ""]
        # Each value as its widget takes it: a stored run's steps over the widget's maximum, or a degree
        # the dropdown lacks, would fail the next click's input check.
        values += [_follow_value(size[k], size_vals[k]) if k in size_vals else gr.skip() for k in size_keys]
        values += [
            _follow_value(profile[k], profile_vals[k]) if k in profile_vals else gr.skip() for k in PROFILE_DEFAULTS
        ]
        values += [_follow_value(plan[k], size_vals[k]) if k in size_vals else gr.skip() for k in plan_keys]
        return values

    advice["apply"].click(
        on_apply,
        [advice["state"], advice["apply_choice"], advice["source"]],
        outputs,
        api_visibility="undocumented",
    )


# --- Plan tab ------------------------------------------------------------------------------------

_PLAN_COLUMNS = ["rank", "layout", "tokens/s", "step ms", "MFU %", "memory GiB", "memory %"]


@functools.lru_cache(maxsize=16)
def _measured_link(store_root: str, hardware_name: str, newest_run: str):
    """The newest distributed run's measured collective bandwidth on this device (advisor.analysis.commbw), read
    once per store state (``newest_run`` changes when a run is added)."""
    from advisor.analysis.commbw import link_for
    from advisor.spec.presets import get_hardware

    return link_for(RunStore(store_root), get_hardware(hardware_name))


def plan_view(
    model: str,
    gpu: str,
    gpus: float,
    seq: float,
    global_batch: float,
    precisions: list,
    offload: bool,
    measured_comm: bool = True,
):
    """Plan tab: (summary, ranked layouts, explanation, memory vs tokens/s figure of every layout that
    fits) for a model on N devices; with ``measured_comm``, collectives run at the bandwidth measured by
    this device's newest distributed run, where the store has one."""
    from advisor.estimate.planner import PlanRequest, layout_label, plan

    empty = pd.DataFrame(columns=_PLAN_COLUMNS)
    try:
        from advisor.spec.presets import get_hardware, get_model

        link = None
        if measured_comm:
            store = _store()
            runs, _ = store.list_runs()
            link = _measured_link(str(store.root), gpu, runs[0].run_id if runs else "")
        req = PlanRequest(
            model=get_model(model),
            hardware=get_hardware(gpu),
            measured_link=link,
            gpus=_as_int(gpus),
            seq_len=_as_int(seq),
            global_batch=_as_int(global_batch),
            precisions=tuple(precisions or ()),
            allow_offload=bool(offload),
        )
        result = plan(req)
    except AdvisorError as err:
        return f"### Cannot plan\n{err}", empty, "", None
    except Exception:
        log.exception("plan_view failed")
        return "### Internal error\nThe planner failed unexpectedly; see the server log.", empty, "", None
    rows = [
        [
            e.rank,
            layout_label(e.setup),
            round(e.estimate.tokens_per_s),
            round(e.estimate.step_time_ms, 1),
            round(100 * e.estimate.mfu_frac, 1),
            round(e.estimate.memory.total_bytes / 2**30, 1),
            round(100 * e.estimate.memory_frac, 1),
        ]
        for e in result.top
    ]
    summary = (
        f"### {len(result.top)} layouts of {result.fitting:,} that fit\n"
        f"{result.considered:,} combinations considered ({result.invalid:,} invalid, {result.no_fit:,} do not fit), "
        f"{result.estimated:,} estimated, in {result.elapsed_s:.2f} s."
    )
    figure = plan_scatter_figure(result) if result.points else None
    return summary, pd.DataFrame(rows, columns=_PLAN_COLUMNS), result.explain(), figure


def build_plan_tab() -> dict:
    """The Plan tab; returns its widgets that follow the shared spec (model, gpu, gpus, seq,
    global_batch, precision), starting on the Size tab's defaults."""
    d = DEFAULTS
    with gr.Row():
        with gr.Column(scale=1, min_width=300):
            model = gr.Dropdown(list(MODELS), value=d["model"], label="Model preset", elem_id="plan-model")
            with gr.Row():
                gpu = gr.Dropdown(list(HARDWARE), value=d["gpu"], label="Device")
                gpus = gr.Number(value=d["gpus"], precision=0, minimum=1, label="GPUs")
            with gr.Row():
                seq = gr.Number(value=d["seq"], precision=0, minimum=1, label="Sequence length")
                global_batch = gr.Number(
                    value=d["global_batch"], precision=0, minimum=1, label="Global batch (sequences)"
                )
            precisions = gr.CheckboxGroup(list(PRECISIONS), value=[d["precision"]], label="Precisions to try")
            offload = gr.Checkbox(value=True, label="Try CPU offload")
            measured = gr.Checkbox(
                value=True, label="Communication at the bandwidth a stored distributed run measured on this device"
            )
            button = gr.Button("Plan", variant="primary", elem_id="plan-run")
        with gr.Column(scale=2):
            summary = gr.Markdown("Pick a model, a device and a GPU count, then press Plan.", elem_id="plan-summary")
            table = gr.Dataframe(
                pd.DataFrame(columns=_PLAN_COLUMNS),
                label="Best layouts",
                interactive=False,
                wrap=True,
                column_widths=["7%", "43%", "11%", "10%", "9%", "11%", "9%"],
            )
            scatter = gr.Plot(label="Every layout that fits: memory per GPU vs tokens/s")
            explain = gr.Markdown()
    button.click(
        plan_view,
        [model, gpu, gpus, seq, global_batch, precisions, offload, measured],
        [summary, table, explain, scatter],
        api_name="plan",
    )
    return {"model": model, "gpu": gpu, "gpus": gpus, "seq": seq, "global_batch": global_batch, "precision": precisions}


# --- History tab ---------------------------------------------------------------------------------

_HISTORY_SHOWN = ["run_id", "started_utc", "status", "model", "device_type", "precision", "seq_len"]
_HISTORY_SHOWN += ["micro_batch", "recompute", "step_time_ms", "estimate_step_time_ms", "tokens_per_s"]
_HISTORY_SHOWN += ["mfu_pct", "peak_memory_gib"]
_ANY = "any"


def history_view(model: str | None, status: str | None, device: str | None, text: str | None):
    """History tab: (count line, runs table, predicted-vs-measured figure) for the filters ("any" or
    empty: no filter)."""
    from advisor.present.charts import predicted_measured_figure
    from advisor.store.history import predicted_vs_measured, run_table

    def pick(v):
        return None if v in (None, "", _ANY) else v

    store = _store()
    try:
        table = run_table(store, model=pick(model), status=pick(status), device=pick(device), text=pick(text))
        pvm = predicted_vs_measured(store)
    except AdvisorError as err:
        return f"### Cannot list runs\n{err}", pd.DataFrame(columns=_HISTORY_SHOWN), None
    except Exception:
        log.exception("history_view failed")
        return "### Internal error\nThe runs could not be listed; see the server log.", pd.DataFrame(), None
    shown = table[_HISTORY_SHOWN].round(3)
    line = f"**{len(table)} run{'s' * (len(table) != 1)}** in `{store.root.name}/` match"
    return line, shown, predicted_measured_figure(pvm) if len(pvm) else None


def history_filters():
    """The filter dropdowns' choices from the store (models, statuses, device types)."""
    from advisor.store.history import filter_choices, run_table

    try:
        c = filter_choices(run_table(_store()))
    except Exception:  # the filters stay at "any"; history_view reports what is wrong
        log.exception("history_filters failed")
        return tuple(gr.skip() for _ in range(3))
    return tuple(gr.Dropdown(choices=[_ANY, *values], value=_ANY) for values in (c.models, c.statuses, c.devices))


def compare_view(run_a: str | None, run_b: str | None):
    """History tab: (summary, spec differences, metrics side by side, phase figure) of two runs."""
    from advisor.present.charts import compare_phase_figure
    from advisor.store.history import compare_runs

    empty = pd.DataFrame(columns=["field", "a", "b"]), pd.DataFrame(columns=["metric", "a", "b", "change_pct"]), None
    if not run_a or not run_b:
        return ("Pick two runs to compare (A and B).", *empty)
    try:
        c = compare_runs(_store(), run_a, run_b)
    except AdvisorError as err:
        return (f"### Cannot compare\n{err}", *empty)
    except Exception:
        log.exception("compare_view failed")
        return ("### Internal error\nThe comparison failed unexpectedly; see the server log.", *empty)
    diff = c.spec_diff.astype(str) if len(c.spec_diff) else c.spec_diff
    figure = compare_phase_figure(c.metrics_a, c.metrics_b, f"A {run_a}", f"B {run_b}")
    return f"### A `{run_a}` vs B `{run_b}`\n{c.summary}", diff, c.metrics.round(3), figure


def calibrate_view(sweep_runs: float, request: gr.Request | None = None):
    """History tab: calibrate this machine (a sweep of short profiled steps, then the fit), yielding
    progress, then the fitted calibration's report."""
    from advisor.advice.calibrate import calibrate_machine, format_calibration

    n = _as_int(sweep_runs)
    yield "### Starting the calibration…"
    result = yield from _in_background(
        "calibrate",
        request,
        lambda on_progress, cancel: calibrate_machine(_store(), n, on_progress=on_progress, cancel=cancel),
        lambda done, total, message: f"### Calibrating: {done} of {total} runs done\n{message}",
    )
    if isinstance(result, str):
        yield f"### Not calibrated\n{result}"
        return
    cal, path, sweep = result
    head = f"### Calibrated on {cal.n_runs} runs"
    if len(sweep) < n:
        head += f" (sweep cancelled: {len(sweep)} of {n} runs made, the last one cancelled)"
    yield f"{head}\n```\n{format_calibration(cal, path)}\n```"


def cancel_calibration(request: gr.Request | None = None) -> str:
    return _cancel(
        "calibrate", request, "### Cancelling the run in flight…", "No calibration of yours is running here to cancel."
    )


def build_history_tab() -> dict:
    """The History tab; returns by name the widgets to fill on page load: the filters (model, status,
    device dropdowns, then the search box), the list's outputs and the two run pickers."""
    with gr.Row():
        model = gr.Dropdown([_ANY], value=_ANY, label="Model", elem_id="history-model")
        status = gr.Dropdown([_ANY], value=_ANY, label="Status")
        device = gr.Dropdown([_ANY], value=_ANY, label="Device")
        text = gr.Textbox(label="Search id, model, message", max_lines=1)
        refresh = gr.Button("Refresh", size="sm")
    count = gr.Markdown(elem_id="history-count")
    table = gr.Dataframe(
        pd.DataFrame(columns=_HISTORY_SHOWN),
        label="Runs (sort or filter with ⋮ on a column header)",
        interactive=False,
        wrap=True,
    )
    with gr.Row():
        run_a = _run_dropdown("Run A", elem_id="history-a")
        run_b = _run_dropdown("Run B", elem_id="history-b")
        button = gr.Button("Compare", variant="primary", elem_id="history-compare")
    summary = gr.Markdown("Pick two runs and press Compare.", elem_id="history-summary")
    with gr.Row():
        diff = gr.Dataframe(
            pd.DataFrame(columns=["field", "a", "b"]),
            label="Spec differences",
            interactive=False,
            wrap=True,
            elem_id="history-diff",
        )
        metrics = gr.Dataframe(
            pd.DataFrame(columns=["metric", "a", "b", "change_pct"]),
            label="Measured, side by side",
            interactive=False,
            wrap=True,
        )
    with gr.Row():
        phases = gr.Plot(label="Step phases, A and B")
        pvm = gr.Plot(label="Predicted vs measured step time")
    with gr.Accordion("Calibrate this machine", open=False):
        gr.Markdown(
            "Profiles short steps of small models on this machine, then fits the regression that corrects the "
            "estimator on every run of this device in the store (the Advice tab's *calibrated* column)."
        )
        with gr.Row():
            sweep_runs = gr.Number(value=12, precision=0, minimum=0, maximum=200, label="Sweep runs (0: fit only)")
            calibrate = gr.Button("Calibrate", variant="primary", elem_id="history-calibrate")
            cancel = gr.Button("Cancel")
        calibration = gr.Markdown(elem_id="history-calibration")
    filters = [model, status, device, text]
    calibrate.click(
        calibrate_view, sweep_runs, calibration, concurrency_limit=1, concurrency_id="device", api_name="calibrate"
    ).then(history_view, filters, [count, table, pvm], api_visibility="undocumented")
    cancel.click(cancel_calibration, None, calibration, queue=False, api_visibility="undocumented")
    gr.on(
        [model.change, status.change, device.change, text.submit, refresh.click],
        history_view,
        filters,
        [count, table, pvm],
        api_visibility="undocumented",
    )
    button.click(compare_view, [run_a, run_b], [summary, diff, metrics, phases], api_name="compare")
    return {"filters": filters, "outputs": [count, table, pvm], "run_a": run_a, "run_b": run_b}


# --- One spec across tabs ------------------------------------------------------------------------

SHARED_KEYS = ("model", "gpu", "gpus", "seq", "micro_batch", "global_batch", "precision", "recompute")
SHARED_KEYS += ("optimizer", "optimizer_impl")
"""Widgets that mean the same on every tab that has them: a user's change on one tab is copied to
the others (the Profile tab keeps its own device: it runs on this machine)."""


def _follow_value(component: gr.components.Component, value):
    """``value`` as ``component`` takes it, or gr.skip() where it has no such choice (fp8 on the
    Profile tab) or is out of its range (a global batch of 0 on the Plan tab)."""
    if value is None:
        return gr.skip()
    if isinstance(component, gr.CheckboxGroup):
        value = [value]
    choices = getattr(component, "choices", None)
    if choices is not None and isinstance(component, gr.Radio | gr.Dropdown | gr.CheckboxGroup):
        allowed = {v for _, v in choices}
        if not set(value if isinstance(value, list) else [value]) <= allowed:
            return gr.skip()
    if isinstance(component, gr.Number):
        low, high = getattr(component, "minimum", None), getattr(component, "maximum", None)
        if (low is not None and value < low) or (high is not None and value > high):
            return gr.skip()
    return value


def fit_seq_to_model(model: str | None, seq: float | None):
    """The sequence length a newly picked preset can take: its learned positions' count where ``seq``
    runs past them (GPT-2's 1024 against the default 8192, which failed the estimate at once), else
    gr.skip()."""
    make = MODELS.get(model or "")
    if make is None or seq is None:
        return gr.skip()
    spec = make()
    if spec.position == "learned" and seq > spec.max_positions:
        return spec.max_positions
    return gr.skip()


def fit_impl_to_optimizer(optimizer: str | None, impl: str | None):
    """Optimizer kernels the picked optimizer has: Adafactor has no fused kernel, so a fused choice
    becomes foreach (the next fastest) instead of an error; else gr.skip()."""
    return "foreach" if optimizer == "adafactor" and impl == "fused" else gr.skip()


def wire_model_limits(*tabs: dict) -> None:
    """On each tab: a preset picked clears a loaded config.json (which would go on winning over the
    dropdown, unseen), and the sequence length and optimizer kernels follow what the pick allows."""
    quiet = {"api_visibility": "undocumented", "show_progress": "hidden", "queue": False}
    configs = [tab["config_file"] for tab in tabs if "config_file" in tab]
    for tab in tabs:
        if configs:  # a preset picked on any tab reaches the Size tab by link_tabs, which fires no .input there
            tab["model"].input(lambda: [None] * len(configs) if len(configs) > 1 else None, None, configs, **quiet)
        if "seq" in tab:
            tab["model"].change(fit_seq_to_model, [tab["model"], tab["seq"]], tab["seq"], **quiet)
        if "optimizer" in tab and "optimizer_impl" in tab:
            tab["optimizer"].change(
                fit_impl_to_optimizer, [tab["optimizer"], tab["optimizer_impl"]], tab["optimizer_impl"], **quiet
            )


def _copier(targets: list) -> Callable:
    """The event function that copies a value to ``targets``: a list of values for several, the bare
    value for one (Gradio reads a one-output function's list as the value itself: the GPU count of
    the Size tab arrived on the Plan tab as [64])."""
    if len(targets) == 1:
        return lambda v, _c=targets[0]: _follow_value(_c, v)
    return lambda v, _t=targets: [_follow_value(c, v) for c in _t]


def link_tabs(*tabs: dict) -> None:
    """Copy each user change of a shared widget to the same widget on the other tabs. ``.input``
    fires on user changes only, so a copied value does not echo back."""
    for key in SHARED_KEYS:
        members = [tab[key] for tab in tabs if key in tab]
        for source in members:
            if isinstance(source, gr.CheckboxGroup):
                continue  # several precisions to try do not make one
            targets = [c for c in members if c is not source]
            if not targets:
                continue
            source.input(
                _copier(targets),
                source,
                targets,
                api_visibility="undocumented",
                show_progress="hidden",
                queue=False,
            )


def _hardware_key(hw) -> str | None:
    """The HARDWARE key of a device spec: "cpu" for any CPU host (its name carries the core count of
    the machine that ran it), else the preset of the same name; None for a device the presets lack."""
    if hw.kind == "cpu":
        return "cpu"
    for key, make in HARDWARE.items():
        if make().name == hw.name:
            return key
    return None


def size_values(setup) -> dict:
    """The Size tab's widget values (DEFAULTS keys) that describe ``setup``; the model only where it
    is a preset (an imported config.json stays in its file widget)."""
    t, p = setup.train, setup.parallel
    values = {k: getattr(t, k) for k in ("precision", "optimizer", "optimizer_impl", "framework", "recompute")}
    values |= {"seq": t.seq_len, "micro_batch": t.micro_batch, "global_batch": t.global_batch}
    values |= {"flash_attention": t.flash_attention, "fp32_grads": t.fp32_grads, "gpus": setup.gpus}
    values |= {k: getattr(t, k) for k in ("recompute_layers", "offload_activations", "compile", "fused_loss")}
    values |= {k: str(getattr(p, k)) for k in ("tp", "pp", "vpp", "cp", "ep", "zero")}
    values |= {"sequence_parallel": p.sequence_parallel, "offload": p.offload}
    if setup.model.name in MODELS:
        values["model"] = setup.model.name
    if setup.hardware is not None and (key := _hardware_key(setup.hardware)):
        values["gpu"] = key
    return values


def profile_values(setup, options: dict | None) -> dict:
    """The Profile tab's widget values (PROFILE_DEFAULTS keys) for ``setup`` and a run's options; the
    distributed layout only with a run's options."""
    t = setup.train
    keys = ("micro_batch", "global_batch", "recompute", "optimizer", "optimizer_impl", "recompute_layers")
    values = {k: getattr(t, k) for k in keys}
    values |= {"offload_activations": t.offload_activations, "fp8_recipe": t.fp8_recipe}
    values |= {"seq": t.seq_len, "offload": setup.parallel.offload == "optimizer", "precision": t.precision}
    if setup.model.name in MODELS:
        values["model"] = setup.model.name
    opts = options or {}
    for key, name in (("device", "device"), ("steps", "steps"), ("layers", "layers"), ("compile", "compile_model")):
        if key in opts:
            values[name] = opts[key]
    for key in ("num_workers", "pin_memory", "nproc", "unified_memory"):
        if key in opts:
            values[key] = opts[key]
    if options is not None:  # a stored run's own layout (a Size tab setup's GPUs are not this machine's)
        p = setup.parallel
        values |= {"tp": str(p.tp), "pp": str(p.pp), "zero": str(p.zero), "sequence_parallel": p.sequence_parallel}
    return values


def build_app() -> gr.Blocks:
    """The whole app; tabs are added here as the product grows."""
    with gr.Blocks(title="LLM training advisor") as demo:
        gr.Markdown(
            "# LLM training advisor\nSize a training setup instantly (memory per GPU, step time, MFU), then "
            "profile a real step on this machine."
        )
        with gr.Tab("Size"):
            size, size_outputs = build_size_tab()
        with gr.Tab("Profile"):
            profile, runs = build_profile_tab()
        with gr.Tab("Analyze"):
            analyze_runs = build_analyze_tab()
        with gr.Tab("Advice"):
            advice = build_advice_tab([size[k] for k in SIZE_KEYS])
        with gr.Tab("Plan"):
            plan = build_plan_tab()
        with gr.Tab("History"):
            history = build_history_tab()
        link_tabs(size, profile, plan)
        wire_model_limits(size, profile, plan)
        wire_apply(advice, size, profile, plan)
        size_inputs = [size[k] for k in SIZE_KEYS]
        demo.load(size_view, inputs=size_inputs, outputs=size_outputs, api_visibility="undocumented")
        # Opens on a first recommendation: the advice on the default setup.
        demo.load(advice_view, advice["advise_inputs"], advice["outputs"], api_visibility="undocumented").then(
            apply_choices, advice["state"], advice["apply_choice"], api_visibility="undocumented"
        )
        for picker in (runs, analyze_runs, advice["runs"], history["run_b"]):
            demo.load(run_choices, None, picker, api_visibility="undocumented")
        demo.load(lambda: run_choices(1), None, history["run_a"], api_visibility="undocumented")
        demo.load(history_filters, None, history["filters"][:3], api_visibility="undocumented")
        demo.load(history_view, history["filters"], history["outputs"], api_visibility="undocumented")
    return demo


def auth_from_env(value: str | None) -> list[tuple[str, str]] | None:
    """``ADVISOR_AUTH="user:password[,user2:password2]"`` as Gradio's auth list; None when unset.
    Raises ValueError naming the malformed entry (never echoing a password)."""
    if not value:
        return None
    pairs = []
    for i, entry in enumerate(value.split(","), 1):
        user, sep, password = entry.strip().partition(":")
        if not sep or not user or not password:
            raise ValueError(f"ADVISOR_AUTH entry {i} is not user:password (both non-empty, comma-separated entries)")
        pairs.append((user, password))
    return pairs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``python app.py [--host H] [--port P] [--traces DIR]``; the flags override ADVISOR_HOST,
    ADVISOR_PORT and ADVISOR_TRACES_DIR, which override the defaults."""
    parser = argparse.ArgumentParser(
        prog="python app.py",
        description="The LLM training advisor's web app: Size, Profile, Analyze, Advice, Plan and History tabs.",
        epilog="ADVISOR_AUTH='user:password[,user2:password2]' asks for a login (needed to serve beyond localhost).",
    )
    parser.add_argument(
        "--host", default=os.environ.get("ADVISOR_HOST", "127.0.0.1"), help="address to bind (default: %(default)s)"
    )
    parser.add_argument("--port", type=int, default=None, help="port (default: ADVISOR_PORT or 7860)")
    parser.add_argument("--traces", default=None, help="the run store (default: ADVISOR_TRACES_DIR or traces/)")
    args = parser.parse_args(argv)
    if args.port is None:
        try:
            args.port = int(os.environ.get("ADVISOR_PORT", "7860"))
        except ValueError:
            parser.error(f"ADVISOR_PORT={os.environ['ADVISOR_PORT']!r}: must be a port number (1 to 65535)")
    if not 1 <= args.port <= 65535:
        parser.error(f"--port {args.port}: must be from 1 to 65535")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if args.traces:
        os.environ["ADVISOR_TRACES_DIR"] = args.traces
    host, port = args.host, args.port
    try:
        auth = auth_from_env(os.environ.get("ADVISOR_AUTH"))
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    if host not in ("127.0.0.1", "localhost") and auth is None:
        log.warning("serving on %s without a login: set ADVISOR_AUTH=user:password to require one", host)
    build_app().queue(default_concurrency_limit=16).launch(
        server_name=host,
        server_port=port,
        max_file_size=MAX_UPLOAD,
        allowed_paths=[str(_store().root)],
        auth=auth,
    )


if __name__ == "__main__":
    main()

"""The Profile tab: a short real training step on this machine in a child process (torchrun for
several), its stored runs, and the view of one run."""

from __future__ import annotations

import functools

import gradio as gr
import pandas as pd

from advisor.analysis.summary import load_trace
from advisor.errors import AdvisorError
from advisor.present.charts import measured_memory_figure, nvml_figure, phase_figure, roofline_figure
from advisor.present.views import TOP_OPS_COLUMNS, run_head, run_summary, top_ops_table
from advisor.run.launcher import local_device_type, profile_run
from advisor.spec.defaults import PROFILE_DEFAULTS, setup_value
from advisor.spec.options import RunOptions
from advisor.spec.presets import MODELS, fastest_precision, local_hardware
from advisor.spec.setup import make_setup
from advisor.spec.specs import FP8_RECIPES, OPTIMIZER_IMPLS, OPTIMIZERS, PRECISIONS, RECOMPUTE_MODES
from advisor.store.runstore import RunInfo
from webui import common
from webui.common import ROOFLINE_LABEL, as_int, block_count, degree_dropdown, guarded, run_dropdown, spec_number

PROFILE_KEYS = ["model", "seq", "micro_batch", "global_batch", "precision", "recompute", "optimizer", "offload"]
PROFILE_KEYS += ["device", "steps", "layers", "num_workers", "pin_memory", "compile_model", "optimizer_impl"]
PROFILE_KEYS += ["nproc", "tp", "pp", "zero", "sequence_parallel", "recompute_layers", "offload_activations"]
PROFILE_KEYS += ["fp8_recipe", "unified_memory"]
"""The Profile tab's inputs in profile_view's parameter order (the /profile endpoint's)."""
_RENAMED = {"compile_model": "compile"}  # the tab's name of a PROFILE_DEFAULTS key


def _tab_values(d: dict) -> dict:
    """PROFILE_DEFAULTS as the tab's widgets take them: this machine's fastest precision where None
    (bf16 on a GPU; reading the GPU's name would start CUDA in the UI process, so a V100 user picks
    fp16), the optimizer offload as a checkbox."""
    values = {k: d[_RENAMED.get(k, k)] for k in PROFILE_KEYS}
    if values["precision"] is None:
        on_gpu = local_device_type("auto") == "cuda"
        values["precision"] = "bf16" if on_gpu else fastest_precision(local_hardware("cpu"))
    values["offload"] = values["offload"] == "optimizer"
    return values


PROFILE_INPUTS = _tab_values(PROFILE_DEFAULTS)
"""The Profile tab's starting values by PROFILE_KEYS name. nproc > 1 runs the step under torchrun with
the layout dp = nproc / (tp x pp), ZeRO 0 = DDP, 1-2 = FSDP2 without and 3 with resharding.
recompute_layers: with full checkpointing, only that many blocks recompute (0: all); offload_activations:
that many blocks' saved activations go to host memory and back; fp8 runs torchao's float8 linears with
fp8_recipe's scaling; unified_memory runs the step's CUDA tensors from managed memory."""


def no_run_outputs():
    return None, None, None, None, pd.DataFrame(columns=TOP_OPS_COLUMNS), None, None


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
    roofline, _ = common.roofline_of(table)
    return common.timeline_of(table), roofline_figure(roofline.table) if roofline else None


def run_view(run: RunInfo):
    """(summary markdown, phase figure, memory figure, NVML figure, step-timeline figure, top-ops
    table, trace file, roofline figure) of a run; outputs added later come last, so an API caller's
    positions keep their meaning."""
    m = run.metrics()
    if m is None:
        return (run_head(run.run_id, run.record), *no_run_outputs())
    trace = run.trace_file()
    timeline, roofline = _run_trace_figures(str(run.path), trace.stat().st_mtime_ns if trace else 0)
    figures = (phase_figure(m), measured_memory_figure(m), nvml_figure(run.nvml_samples()), timeline)
    top = top_ops_table(run.top_ops(), m["device_type"])
    return (run_summary(run.run_id, run.record, m), *figures, top, str(trace) if trace else None, roofline)


def _setup_and_options(v: dict):
    """The Setup and RunOptions of the tab's values (PROFILE_KEYS); raises AdvisorError."""
    n = as_int(v["nproc"]) or 1
    single_offload = bool(v["offload"]) and n == 1  # one process: ZeRO-Offload; several: FSDP2's offload
    ints = {k: as_int(v[k]) for k in ("tp", "pp", "seq", "micro_batch")}
    ints |= {k: as_int(v[k]) or 0 for k in ("global_batch", "recompute_layers", "offload_activations")}
    setup = make_setup(
        model=v["model"],
        # A placeholder the run replaces with this machine's device; fp8 on a CPU must reach the
        # run, which files it as refused with the reason (a CPU preset has no fp8 math to validate).
        gpu="cpu" if v["device"] == "cpu" and v["precision"] != "fp8" else "h100",
        gpus=n,
        zero=1 if single_offload else as_int(v["zero"]),
        sequence_parallel=bool(v["sequence_parallel"]),
        **ints,
        **{k: v[k] for k in ("precision", "recompute", "fp8_recipe", "optimizer", "optimizer_impl")},
        framework="pytorch",
        offload="optimizer" if v["offload"] else "none",
    )
    options = RunOptions(
        device=v["device"],
        nproc=n,
        steps=as_int(v["steps"]),
        layers=as_int(v["layers"]) or 0,
        num_workers=as_int(v["num_workers"]) or 0,
        **{k: bool(v[k]) for k in ("pin_memory", "unified_memory")},
        compile=bool(v["compile_model"]),
    )
    return setup, options


def _progress(done: int, total: int, message: str):
    return (f"### Running: {message} ({100 * done // total} %)", *(gr.skip() for _ in no_run_outputs()))


@guarded("Invalid setup", "The profiled run", no_run_outputs)
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
    progress, then the run's view. The parameters, PROFILE_KEYS in order, name the /profile endpoint's."""
    setup, options = _setup_and_options({k: v for k, v in locals().items() if k in PROFILE_KEYS})
    yield ("### Starting the child process…", *no_run_outputs())
    store = common.store()
    result = yield from common.in_background(
        "profile",
        request,
        lambda on_progress, cancel: profile_run(setup, options, store, on_progress=on_progress, cancel=cancel),
        _progress,
    )
    yield (f"### Not run\n{result}", *no_run_outputs()) if isinstance(result, str) else run_view(result)


def cancel_profile(request: gr.Request | None = None) -> str:
    return common.cancel_message("profile", request, "### Cancelling…", "Nothing of yours is running here to cancel.")


@guarded("Cannot open run", "Showing the run", no_run_outputs)
def open_run(run_id: str | None):
    """Show a stored run chosen in the list."""
    if not run_id:
        return ("Pick a run.", *no_run_outputs())
    return run_view(common.store().load(run_id))


def picker_after_profile(summary: str | None):
    """The stored-run picker after a Profile click: on the run the summary shows (the one just made,
    whatever its status), else only its choices refreshed, so a refusal's message ("### Not run") is
    not replaced by another run's view through the picker's change."""
    runs, _ = common.store().list_runs()
    ids = [r.run_id for r in runs]
    made = next((i for i in ids if f"`{i}`" in (summary or "")), None)
    return gr.Dropdown(choices=ids, value=made) if made else gr.update(choices=ids)


def profile_values(setup, options: dict | None) -> dict:
    """The Profile tab's widget values (PROFILE_KEYS) for ``setup`` and a run's options; the
    distributed layout only with a run's options (a Size tab setup's GPUs are not this machine's)."""
    keys = ["model", "seq", "micro_batch", "global_batch", "precision", "recompute", "optimizer", "optimizer_impl"]
    keys += ["recompute_layers", "offload_activations", "fp8_recipe"]
    if options is not None:
        keys += ["tp", "pp", "zero", "sequence_parallel"]
    values = {k: setup_value(setup, k) for k in keys}
    values |= {k: str(values[k]) for k in ("tp", "pp", "zero") if k in values}
    values["offload"] = setup.parallel.offload == "optimizer"
    if values["model"] not in MODELS:
        del values["model"]
    opts = options or {}
    names = {"compile": "compile_model"}
    for key in ("device", "steps", "layers", "compile", "num_workers", "pin_memory", "nproc", "unified_memory"):
        if key in opts:
            values[names.get(key, key)] = opts[key]
    return values


def _model_inputs(d: dict) -> dict:
    w = {"model": gr.Dropdown(list(MODELS), value=d["model"], label="Model preset")}
    with gr.Row():
        w["seq"] = spec_number(d["seq"], "Sequence length", low=1)
        w["micro_batch"] = spec_number(d["micro_batch"], "Micro-batch", low=1)
        w["global_batch"] = spec_number(d["global_batch"], "Global batch", low=0)
    with gr.Row():
        w["precision"] = gr.Radio(list(PRECISIONS), value=d["precision"], label="Precision")
        w["fp8_recipe"] = gr.Radio(
            list(FP8_RECIPES), value=d["fp8_recipe"], label="fp8 scaling (torchao)", elem_id="profile-fp8-recipe"
        )
    w["recompute"] = gr.Radio(
        list(RECOMPUTE_MODES), value=d["recompute"], label="Activation checkpointing", elem_id="profile-recompute"
    )
    with gr.Row():
        w["recompute_layers"] = block_count(
            d["recompute_layers"], "Blocks that recompute (full; 0 = all)", elem_id="profile-recompute-layers"
        )
        w["offload_activations"] = block_count(
            d["offload_activations"], "Blocks' activations offloaded to host", elem_id="profile-offload-activations"
        )
    w["unified_memory"] = gr.Checkbox(
        value=d["unified_memory"],
        label="Unified Memory (CUDA managed; capped at free GPU memory on PCIe GPUs)",
        elem_id="profile-unified-memory",
    )
    return w


def _run_inputs(d: dict) -> dict:
    w = {}
    with gr.Row():
        w["optimizer"] = gr.Radio(list(OPTIMIZERS), value=d["optimizer"], label="Optimizer")
        w["optimizer_impl"] = gr.Radio(list(OPTIMIZER_IMPLS), value=d["optimizer_impl"], label="Optimizer kernels")
    with gr.Row():
        w["offload"] = gr.Checkbox(value=d["offload"], label="Offload optimizer to host (GPU only)")
        w["compile_model"] = gr.Checkbox(value=d["compile_model"], label="torch.compile")
    with gr.Row():
        w["device"] = gr.Radio(["auto", "cpu", "cuda"], value=d["device"], label="Device")
        w["steps"] = spec_number(d["steps"], "Steps", low=1, high=100)
        w["layers"] = spec_number(d["layers"], "Proxy layers (0 = all)", low=0)
    with gr.Row():
        w["num_workers"] = spec_number(d["num_workers"], "DataLoader workers", low=0)
        w["pin_memory"] = gr.Checkbox(value=d["pin_memory"], label="pin_memory")
    return w


def _distributed_inputs(d: dict) -> dict:
    w = {}
    with gr.Accordion("Distributed (torchrun: gloo on the CPU, NCCL on GPUs)", open=False):
        with gr.Row():
            w["nproc"] = spec_number(d["nproc"], "Processes", low=1, high=64, elem_id="profile-nproc")
            w["tp"] = degree_dropdown([1, 2, 4, 8], d["tp"], "TP")
            w["pp"] = degree_dropdown([1, 2, 4, 8], d["pp"], "PP")
            w["zero"] = degree_dropdown([0, 1, 2, 3], d["zero"], "ZeRO / FSDP2", elem_id="profile-zero")
        w["sequence_parallel"] = gr.Checkbox(value=d["sequence_parallel"], label="Sequence parallel (with TP)")
        gr.Markdown(
            "<small>dp = processes / (tp x pp); ZeRO 0 is DDP, 1-2 FSDP2 without resharding, 3 with. "
            "Several nodes: the CLI's `--nnodes --rdzv-endpoint --rdzv-id` (README).</small>"
        )
    return w


def _outputs() -> list:
    summary = gr.Markdown("Press **Run profiled step**, or open a stored run.", elem_id="profile-summary")
    with gr.Row():
        phases = gr.Plot(label="Step phases")
        memory = gr.Plot(label="Peak memory")
    nvml = gr.Plot(label="NVML")
    timeline = gr.Plot(label="One step: phases and top ops or kernels")
    roofline = gr.Plot(label=ROOFLINE_LABEL, elem_id="profile-roofline")
    top_ops = gr.Dataframe(
        pd.DataFrame(columns=TOP_OPS_COLUMNS),
        label="Top ops by self time",
        interactive=False,
        wrap=True,
        column_widths=["52%", "12%", "12%", "12%", "12%"],
        elem_id="profile-top-ops",
    )
    trace = gr.File(label="Chrome trace (open in ui.perfetto.dev)", interactive=False)
    return [summary, phases, memory, nvml, timeline, top_ops, trace, roofline]


def build_profile_tab() -> tuple[dict, gr.Dropdown]:
    """The Profile tab: its input widgets by PROFILE_KEYS name, and its stored-run picker."""
    d = PROFILE_INPUTS
    with gr.Row():
        with gr.Column(scale=1, min_width=320):
            widgets = _model_inputs(d) | _run_inputs(d) | _distributed_inputs(d)
            with gr.Row():
                run_btn = gr.Button("Run profiled step", variant="primary", elem_id="profile-run")
                cancel_btn = gr.Button("Cancel")
            with gr.Row():
                runs = run_dropdown("Stored runs")
                refresh = gr.Button("Refresh list", size="sm")
        with gr.Column(scale=2):
            outputs = _outputs()
    inputs = [widgets[k] for k in PROFILE_KEYS]
    run_btn.click(profile_view, inputs, outputs, api_name="profile", concurrency_limit=1, concurrency_id="device").then(
        picker_after_profile, outputs[0], runs, api_visibility="undocumented"
    )
    cancel_btn.click(cancel_profile, None, outputs[0], api_visibility="undocumented", queue=False)
    runs.change(open_run, runs, outputs, api_name="open_run")
    refresh.click(common.run_choices, None, runs, api_visibility="undocumented")
    return widgets, runs

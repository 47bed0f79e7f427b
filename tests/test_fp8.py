"""fp8 in the eager step: torchao's float8 linears where there are fp8 units, a filed refusal elsewhere.

torchao installs on the CPU build (requirements-dev.txt) and its float8 matmuls run on the CPU, so the
converted step runs here with ``fp8_emulate`` (numerics only: a CPU has no fp8 units).
"""

import importlib.util

import pytest
import torch

from advisor.errors import Refused
from advisor.run import fp8
from advisor.run.child import RunOptions, _fp8_summary
from advisor.run.fp8 import convert_to_fp8, fp8_refusal
from advisor.run.launcher import profile_run
from advisor.run.model import build_model
from advisor.run.step import build_trainer, make_loader
from advisor.spec.setup import make_setup
from advisor.store.runstore import RunStore

CPU = torch.device("cpu")
needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="torchao is not installed (pip install -r requirements-gpu.txt)"
)


def _setup(precision="fp8", **kw):
    values = {"model": "tiny", "gpu": "h100", "seq": 128, "micro_batch": 2, "optimizer_impl": "foreach"}
    return make_setup(precision=precision, framework="pytorch", **(values | kw))


def _losses(setup, steps=4):
    trainer = build_trainer(setup, CPU, fp8_emulate=True)
    batches = iter(make_loader(setup, steps, 0, False, 0))
    for _ in range(steps):
        trainer.step(batches)
    return trainer


@pytest.mark.slow  # starts a child process or runs seconds of real steps
@needs_torchao
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_converts_the_block_linears_and_trains_like_bf16(recipe):
    from torchao.float8.float8_linear import Float8Linear

    bf16 = _losses(_setup("bf16"))
    trainer = _losses(_setup(fp8_recipe=recipe))
    converted = [n for n, m in trainer.model.named_modules() if isinstance(m, Float8Linear)]
    # Every block linear (q, k, v, o, gate, up, down: 7 x 4 blocks); the tied head stays bf16.
    assert len(converted) == 28 and not any(n.startswith("head") for n in converted)
    assert _fp8_summary(trainer) == {"backend": "torchao", "recipe": recipe, "linears": 28}  # what a run files
    # Measured on tiny, 4 AdamW steps: fp8 losses within 0.05 % of bf16's (tensorwise +0.03 %, rowwise
    # +-0.05 %); fp8's rounding shows, so the float8 path did run.
    assert trainer.losses == pytest.approx(bf16.losses, rel=2e-3)
    assert trainer.losses != bf16.losses


@needs_torchao
def test_fp8_leaves_the_router_and_odd_sized_linears_alone():
    spec = make_setup(model="tiny-moe", gpu="h100").model
    model = build_model(spec)
    # fp8 GEMMs need both dimensions a multiple of 16: an output projection of 250 columns stays.
    model.blocks[0].attn.o_proj = torch.nn.Linear(256, 250, bias=False)
    n = convert_to_fp8(model)
    names = [name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
    # tiny-moe: 4 blocks of q, k, v, o and 4 experts x (gate, up, down), all multiples of 16: 4 x 16 = 64
    # linears, less the odd o_proj. The routers (256 x 4) and the tied head stay.
    assert n == len(names) == 63 and not any(name.endswith(("router", "head")) for name in names)
    assert "blocks.0.attn.o_proj" not in names and type(model.blocks[0].attn.o_proj) is torch.nn.Linear
    with pytest.raises(Exception, match="fp8_recipe='delayed': must be one of tensorwise, rowwise"):
        convert_to_fp8(model, "delayed")


@pytest.mark.slow  # starts a child process or runs seconds of real steps
def test_fp8_on_a_device_without_fp8_units_is_refused_with_the_reason(tmp_path):
    if importlib.util.find_spec("torchao") is not None:
        assert "has no fp8 units" in fp8_refusal(CPU) and "8.9" in fp8_refusal(CPU)
    with pytest.raises(Refused, match="fp8"):
        build_trainer(_setup(), CPU)
    store = RunStore(tmp_path)
    # A plain run first: the refused one is filed beside it and harms nothing.
    run = profile_run(make_setup(model="tiny", gpu="cpu", seq=64), RunOptions(device="cpu", steps=1, warmup=0), store)
    assert run.status == "ok", run.record["message"]
    refused = profile_run(_setup(seq=64), RunOptions(device="cpu", steps=1, warmup=0), store)
    assert refused.status == "refused" and "fp8" in refused.record["message"]
    assert refused.metrics() is None and refused.record["files"] == ["run.json"]
    # Filed as the CPU run it was asked to be (the setup named an H100), so runs --device cpu lists it.
    from advisor.store.history import run_table

    assert refused.record["device_type"] == "cpu"
    assert sorted(run_table(store, device="cpu")["status"]) == ["ok", "refused"]
    runs, damaged = store.list_runs()
    assert sorted(r.status for r in runs) == ["ok", "refused"] and damaged == []
    assert not any((tmp_path / ".staging").iterdir())


def test_fp8_without_torchao_names_how_to_install_it(monkeypatch):
    monkeypatch.setattr(fp8, "torchao_available", lambda: False)
    monkeypatch.setattr(fp8, "transformer_engine_available", lambda: False)
    reason = fp8_refusal(torch.device("cuda"))
    assert "neither is installed" in reason and "requirements-gpu.txt" in reason and "--no-deps" in reason


@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
    reason="needs a GPU with fp8 tensor cores (compute capability 8.9+)",
)
@needs_torchao
def test_fp8_runs_on_a_gpu_with_fp8_units():
    device = torch.device("cuda")
    setup = _setup(seq=512, micro_batch=4)
    trainer = build_trainer(setup, device)
    batches = iter(make_loader(setup, 3, 0, False, 0))
    for _ in range(3):
        trainer.step(batches)
    assert all(torch.isfinite(torch.tensor(trainer.losses)))


def test_transformer_engine_stands_in_where_torchao_is_missing(monkeypatch):
    monkeypatch.setattr(fp8, "torchao_available", lambda: False)
    monkeypatch.setattr(fp8, "transformer_engine_available", lambda: True)
    assert fp8.fp8_backend() == "transformer_engine"
    assert "no fp8 units" in fp8_refusal(CPU)  # TE or not, a CPU has no fp8 units
    assert "needs torchao" in fp8_refusal(CPU, emulate=True)  # TE has no CPU path to emulate with
    monkeypatch.setattr(fp8, "transformer_engine_available", lambda: False)
    assert fp8.fp8_backend() is None and "neither is installed" in fp8_refusal(CPU)
    with pytest.raises(Refused, match="rowwise scaling"):  # filed as 'refused', not 'failed'
        fp8.convert_to_te(build_model(make_setup(model="tiny", gpu="h100").model), "rowwise")


@pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is None or not torch.cuda.is_available(),
    reason="needs TransformerEngine and a CUDA GPU (it does not install on a CPU build)",
)
def test_transformer_engine_linears_keep_the_weights():
    model = build_model(make_setup(model="tiny", gpu="h100").model, device="cuda")
    before = model.blocks[0].attn.q_proj.weight.detach().clone()
    count, context = fp8.convert_to_te(model)
    assert count == 28 and torch.equal(model.blocks[0].attn.q_proj.weight.detach(), before)
    assert context is not None

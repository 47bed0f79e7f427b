"""The project's transformer: parameter count identical to the spec, for every preset and import."""

from pathlib import Path

import pytest
import torch

from advisor.run.model import INIT_STD, MoE, Transformer, build_model, count_parameters, lm_loss
from advisor.spec.hf_config import load_hf_config
from advisor.spec.presets import MODELS, get_model

DATA = Path(__file__).parent / "data" / "hf"


@pytest.mark.parametrize("name", list(MODELS))
def test_built_model_has_the_specs_parameter_count(name):
    spec = get_model(name)
    assert count_parameters(build_model(spec, device="meta")) == spec.n_params


@pytest.mark.parametrize("file", sorted(p.name for p in DATA.glob("*.json")))
def test_imported_configs_build_with_the_same_count(file):
    spec = load_hf_config(DATA / file)
    assert count_parameters(build_model(spec, device="meta")) == spec.n_params


def test_init_and_shapes():
    torch.manual_seed(0)
    spec = get_model("tiny")
    model = build_model(spec)
    w = model.blocks[0].attn.q_proj.weight
    assert w.std().item() == pytest.approx(INIT_STD, rel=0.02)
    assert model.head.weight is model.embed.weight  # tied
    tokens = torch.randint(0, spec.vocab, (2, 16))
    assert model(tokens).shape == (2, 16, spec.vocab)
    loss = model(tokens, tokens)
    assert loss.item() == pytest.approx(torch.log(torch.tensor(float(spec.vocab))).item(), rel=0.15)


def test_moe_routes_top_k_and_adds_the_balancing_loss():
    torch.manual_seed(0)
    spec = get_model("tiny-moe")
    model = build_model(spec)
    moe = [b.mlp for b in model.blocks if isinstance(b.mlp, MoE)]
    assert len(moe) == spec.n_moe_layers == 4
    # Rows each expert's MLP is handed, per MoE layer, counted by a hook on its input.
    routed = {id(m): [] for m in moe}
    for m in moe:
        for e, expert in enumerate(m.experts):
            expert.register_forward_pre_hook(lambda mod, args, m=m, e=e: routed[id(m)].append((e, args[0].shape[0])))
    tokens = torch.randint(0, spec.vocab, (2, 32))
    loss = model(tokens, tokens)
    # 2 x 32 = 64 tokens, each sent to top_k = 2 distinct experts of 4: 128 rows per layer, none to an
    # expert twice, so no expert sees more than the 64 tokens.
    for m in moe:
        assert sum(n for _, n in routed[id(m)]) == 64 * spec.top_k == 128
        assert all(n <= 64 for _, n in routed[id(m)])
    # Switch loss is n_experts * sum f_i P_i: 1.0 for perfectly balanced routing, at least ~1 otherwise.
    assert all(0.9 < m.aux_loss.item() < spec.n_experts for m in moe)
    # The loss is the cross-entropy plus Switch's alpha = 0.01 times the layers' balancing losses
    # (the logits are recomputed without targets: the same weights and tokens route the same way).
    with torch.no_grad():
        ce = lm_loss(model(tokens), tokens)
    aux = sum(m.aux_loss for m in moe)
    assert loss.item() == pytest.approx((ce + Transformer.MOE_AUX_WEIGHT * aux).item(), rel=1e-6)
    assert Transformer.MOE_AUX_WEIGHT * aux.item() > 1e-6 * loss.item()  # large enough for the check to see
    loss.backward()
    assert model.blocks[0].mlp.router.weight.grad is not None


def test_checkpointing_gives_the_same_gradients():
    spec = get_model("tiny")
    tokens = torch.randint(0, spec.vocab, (2, 32))
    grads = {}
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        model = build_model(spec, recompute=mode)
        model(tokens, tokens).backward()
        grads[mode] = [p.grad for p in model.parameters()]
    for mode in ("selective", "full"):
        for a, b in zip(grads["none"], grads[mode], strict=True):
            torch.testing.assert_close(a, b)


@pytest.mark.slow  # starts a child process or runs seconds of real steps
@pytest.mark.parametrize("name", ["tiny", "gpt2-124m"])
def test_unfused_attention_computes_what_sdpa_does(name):
    spec = get_model(name)
    torch.manual_seed(0)
    fused = build_model(spec)
    unfused = build_model(spec, flash=False)
    unfused.load_state_dict(fused.state_dict())
    tokens = torch.randint(0, spec.vocab, (2, 32))
    with torch.no_grad():
        assert torch.allclose(fused(tokens), unfused(tokens), atol=1e-4)


def test_a_compiled_step_compiles_the_model_once(monkeypatch):
    # The first forward caches the RoPE tables on the model. Compiled without them, the second step
    # failed dynamo's guard on the empty cache and compiled the whole model again (1.6 s against a
    # 0.8 s steady step for the 8-layer tiny model at seq 512 on 2 cores), inside the timed steps.
    # Dynamo's guards alone decide a recompile, so the test compiles with its eager backend.
    from advisor.run.launcher import on_this_machine
    from advisor.run.step import build_trainer, make_loader
    from advisor.spec.setup import make_setup

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model: real_compile(model, backend="eager"))
    torch._dynamo.reset()
    setup = on_this_machine(make_setup(gpu="cpu", model="tiny", seq=32, micro_batch=2, precision="bf16"), "cpu")
    trainer = build_trainer(setup, torch.device("cpu"), compile_model=True)
    batches = iter(make_loader(setup, 3 * trainer.grad_accum, 0, False, 0))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            trainer.step(batches)
    assert trainer.model.rope_for(32, torch.device("cpu"))[0].shape[0] == 32

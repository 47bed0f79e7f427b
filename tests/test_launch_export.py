"""Export (advisor.present.export): every framework's output parsed back and checked field by field
against the setup, every emitted name checked against the names read from the framework's source
(tests/data/export_names.json, written by scripts/export_names.py), the refusals and the notes."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the torchtitan TOML is read back on 3.11+ only
    tomllib = None

from advisor.cli import main
from advisor.errors import SpecError
from advisor.present.export import EXPORT_TARGETS, SOURCES, export_setup
from advisor.spec.setup import make_setup

NAMES = json.loads((Path(__file__).parent / "data" / "export_names.json").read_text(encoding="utf-8"))

# Llama-3.1-8B under FSDP (ZeRO-3) with full recompute on one H100 node, 8 micro-batches a step.
FSDP_8B = {"model": "llama-3.1-8b", "gpu": "h100", "gpus": 8, "seq": 8192, "global_batch": 64, "zero": 3}
FSDP_8B |= {"recompute": "full"}
# Llama-3.1-70B on 256 H100s: TP8 x PP4 (2 virtual stages) x CP2 x DP4, SP, selective recompute, ZeRO-1.
BIG_70B = {"model": "llama-3.1-70b", "gpu": "h100", "gpus": 256, "tp": 8, "pp": 4, "vpp": 2, "cp": 2, "seq": 8192}
BIG_70B |= {"global_batch": 512, "recompute": "selective", "zero": 1, "sequence_parallel": True}
# Mixtral-8x7B in fp8 on 64 H100s: TP2 x PP2 x DP16 with EP8, 4 of each stage's 16 blocks recomputed,
# activations of 2 more offloaded, the optimizer in host memory.
MOE = {"model": "mixtral-8x7b", "gpu": "h100", "gpus": 64, "tp": 2, "pp": 2, "ep": 8, "seq": 4096}
MOE |= {"global_batch": 256, "precision": "fp8", "recompute": "full", "recompute_layers": 4}
MOE |= {"offload_activations": 2, "zero": 1, "offload": "optimizer", "sequence_parallel": True}
SETUPS = {"fsdp-8b": FSDP_8B, "70b-tp-pp-cp": BIG_70B, "moe-ep": MOE}


# --- parsers: each framework's format read back with a general parser ------------------------------


def parse_megatron(text: str) -> dict[str, list[str]]:
    """pretrain_gpt.py's arguments: each option and the values after it."""
    command = text[text.index("\ntorchrun ") :].replace("\\\n", " ")
    body = command.split(" pretrain_gpt.py ", 1)[1]
    args: dict[str, list[str]] = {}
    for token in shlex.split(body):
        if token.startswith("--"):
            assert token not in args, f"{token} given twice"
            args[token] = []
            last = token
        else:
            args[last].append(token)
    return args


def parse_nemo(text: str) -> dict[str, object]:
    pairs = [line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#")]
    assert len({k for k, _ in pairs}) == len(pairs), "a key given twice"
    return {k: yaml.safe_load(v) for k, v in pairs}


def _flatten(d: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out |= _flatten(v, f"{prefix}{k}.")
        else:
            out[prefix + k] = v
    return out


def parse_toml(text: str) -> dict[str, object]:
    if tomllib is None:
        pytest.skip("reading TOML back needs Python 3.11's tomllib")
    return _flatten(tomllib.loads(text))


PARSE = {
    "megatron": parse_megatron,
    "nemo": parse_nemo,
    "torchtitan": parse_toml,
    "deepspeed": lambda text: _flatten(json.loads(text)),
    "accelerate": lambda text: _flatten(yaml.safe_load(text)),
}


def _export(setup_kw: dict, framework: str):
    setup = make_setup(**setup_kw)
    out = export_setup(setup, framework)
    return setup, out, PARSE[framework](out.text)


# --- names: every emitted one is the framework's ----------------------------------------------------


def test_names_were_read_at_the_commits_the_exporter_cites():
    for framework in EXPORT_TARGETS:
        repo, commit, _ = SOURCES[framework]
        assert (NAMES[framework]["repo"], NAMES[framework]["commit"]) == (repo, commit)
    # The parser Megatron-LM builds has hundreds of options; a few anchors read by hand in arguments.py.
    meg = NAMES["megatron"]
    assert len(meg["options"]) > 800 and "--recompute-num-layers" in meg["options"]
    assert meg["choices"]["--recompute-granularity"] == ["full", "selective"]
    assert "--bf16" in meg["flags"] and "--num-layers" not in meg["flags"]


@pytest.mark.parametrize("framework", EXPORT_TARGETS)
@pytest.mark.parametrize("name", SETUPS)
def test_every_emitted_name_and_choice_is_the_frameworks(name, framework):
    _, _, parsed = _export(SETUPS[name], framework)
    names = NAMES[framework]
    if framework == "megatron":
        for opt, values in parsed.items():
            assert opt in names["options"], opt
            assert (values == []) == (opt in names["flags"]), (opt, values)
            if opt in names["choices"]:
                assert all(v in names["choices"][opt] for v in values), (opt, values)
        return
    keys = set(parsed) - {"_advisor_notes"}
    assert keys <= set(names["keys"]), keys - set(names["keys"])
    for key, allowed in names.get("choices", {}).items():
        if parsed.get(key) is not None:
            assert parsed[key] in allowed, (key, parsed[key])


# --- field by field, per framework --------------------------------------------------------------


def _one(args: dict, opt: str) -> str:
    (value,) = args[opt]
    return value


@pytest.mark.parametrize("name", SETUPS)
def test_megatron_arguments_say_the_setup(name):
    setup, out, a = _export(SETUPS[name], "megatron")
    m, t, p = setup.model, setup.train, setup.parallel
    shape = {"--num-layers": m.n_layers, "--hidden-size": m.hidden, "--ffn-hidden-size": m.ffn_hidden}
    shape |= {"--num-attention-heads": m.n_heads, "--num-query-groups": m.n_kv_heads, "--vocab-size": m.vocab}
    shape |= {"--seq-length": t.seq_len, "--micro-batch-size": t.micro_batch, "--global-batch-size": setup.global_batch}
    shape |= {"--tensor-model-parallel-size": p.tp, "--pipeline-model-parallel-size": p.pp}
    shape |= {"--context-parallel-size": p.cp}
    assert {k: int(_one(a, k)) for k in shape} == shape
    assert a["--group-query-attention"] == [] and a["--swiglu"] == [] and a["--disable-bias-linear"] == []
    assert _one(a, "--normalization") == "RMSNorm" and _one(a, "--position-embedding-type") == "rope"
    assert "--untie-embeddings-and-output-weights" in a
    assert float(_one(a, "--hidden-dropout")) == 0.0 and _one(a, "--attention-backend") == "flash"
    assert ("--bf16" in a) and ("--fp16" not in a)
    assert ("--sequence-parallel" in a) == p.sequence_parallel
    assert ("--use-distributed-optimizer" in a) == (p.zero == 1)
    if p.zero == 3:
        assert _one(a, "--data-parallel-sharding-strategy") == "optim_grads_params" and "--use-megatron-fsdp" in a
        assert _one(a, "--ckpt-format") == "fsdp_dtensor"
    if t.recompute == "selective":
        assert _one(a, "--recompute-granularity") == "selective" and "--recompute-method" not in a
    if t.recompute == "full":
        method = "block" if t.recompute_layers else "uniform"
        assert (_one(a, "--recompute-granularity"), _one(a, "--recompute-method")) == ("full", method)
        assert int(_one(a, "--recompute-num-layers")) == (t.recompute_layers or 1)
    if p.vpp > 1:
        assert int(_one(a, "--num-virtual-stages-per-pipeline-rank")) == p.vpp
    if m.is_moe:
        moe = (m.n_experts, m.top_k, m.expert_ffn_hidden, p.ep)
        opts = ("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size", "--expert-model-parallel-size")
        assert tuple(int(_one(a, o)) for o in opts) == moe == (8, 2, 14336, 8)
        assert (_one(a, "--fp8-format"), _one(a, "--fp8-recipe")) == ("hybrid", "tensorwise")
        assert int(_one(a, "--cpu-offloading-num-layers")) == 2
        assert "--optimizer-cpu-offload" in a and "--use-precision-aware-optimizer" in a
    # Megatron-LM asserts one CUDA connection with TP or CP (before Blackwell), and Megatron-FSDP more than one.
    assert ("\nexport CUDA_DEVICE_MAX_CONNECTIONS=1\n" in out.text) == ((p.tp > 1 or p.cp > 1) and p.zero < 2)
    # The launcher: 8 processes a node over setup.gpus / 8 nodes.
    assert f"torchrun --nproc-per-node 8 --nnodes {setup.gpus // 8} pretrain_gpt.py" in out.text


def test_megatron_rope_scaling_covers_the_longer_context():
    # Llama-3.1-8B trained to 131,072 positions, extended 2x to run sequences of 262,144 over 8 CP ranks.
    kw = {"model": "llama-3.1-8b", "gpu": "h200", "gpus": 8, "cp": 8, "seq": 262144, "rope_scaling": 2.0}
    _, out, a = _export(kw, "megatron")
    # The extension is linear position interpolation; --use-rope-scaling is Llama 3.x's own trained scaling.
    assert int(_one(a, "--rotary-seq-len-interpolation-factor")) == 2 and "--use-rope-scaling" not in a
    _, _, o = _export(kw, "nemo")
    assert (o["model.seq_len_interpolation_factor"], o["model.seq_length"]) == (2, 262144)
    # arguments.py asserts max_position_embeddings >= seq_length
    assert int(_one(a, "--max-position-embeddings")) == int(_one(a, "--seq-length")) == 262144
    assert "\nexport CUDA_DEVICE_MAX_CONNECTIONS=1\n" in out.text


def test_megatron_moe_layer_pattern_and_uneven_stages():
    # Llama-4 Maverick: MoE in every second block, (i + 1) % 2 == 0, as ModelSpec.n_moe_layers counts them.
    setup, _, a = _export({"model": "llama-4-maverick", "gpu": "h200", "gpus": 64, "tp": 8, "ep": 8}, "megatron")
    pattern = eval(_one(a, "--moe-layer-freq"))  # Megatron's moe_freq_type evaluates the list expression
    assert pattern == [0, 1] * 24 and sum(pattern) == setup.model.n_moe_layers == 24
    # Llama-3.1-405B, 126 blocks over 16 stages: Megatron's split (7, 8 x 14, 7), ends one lighter.
    kw = {"model": "llama-3.1-405b", "gpu": "h100", "gpus": 1024, "tp": 8, "pp": 16, "global_batch": 1024}
    _, _, a = _export(kw, "megatron")
    assert (_one(a, "--decoder-first-pipeline-num-layers"), _one(a, "--decoder-last-pipeline-num-layers")) == ("7", "7")


@pytest.mark.parametrize("name", SETUPS)
def test_nemo_overrides_say_the_setup(name):
    setup, _, o = _export(SETUPS[name], "nemo")
    m, t, p = setup.model, setup.train, setup.parallel
    want = {
        "model.num_layers": m.n_layers,
        "model.hidden_size": m.hidden,
        "model.num_attention_heads": m.n_heads,
        "model.num_query_groups": m.n_kv_heads,
        "model.ffn_hidden_size": m.ffn_hidden,
        "model.gated_linear_unit": True,
        "model.share_embeddings_and_output_weights": False,
        "model.seq_length": t.seq_len,
        "dataset.seq_length": t.seq_len,
        "train.micro_batch_size": t.micro_batch,
        "train.global_batch_size": setup.global_batch,
        "model.tensor_model_parallel_size": p.tp,
        "model.pipeline_model_parallel_size": p.pp,
        "model.virtual_pipeline_model_parallel_size": p.vpp if p.vpp > 1 else None,
        "model.context_parallel_size": p.cp,
        "model.expert_model_parallel_size": p.ep,
        "model.sequence_parallel": p.sequence_parallel,
        "ddp.grad_reduce_in_fp32": True,
        "mixed_precision": "bf16_with_fp8_current_scaling_mixed" if t.precision == "fp8" else "bf16_mixed",
    }
    assert {k: o[k] for k in want} == want
    granularity = {"none": None, "selective": "selective", "full": "full"}[t.recompute]
    assert o["model.recompute_granularity"] == granularity
    # ZeRO-1 is the distributed optimizer; Megatron-FSDP (ZeRO-2/3) runs on it too (arguments.py)
    assert o.get("ddp.use_distributed_optimizer", False) == (p.zero >= 1)
    if p.zero == 3:
        assert (o["ddp.use_megatron_fsdp"], o["ddp.data_parallel_sharding_strategy"]) == (True, "optim_grads_params")
    if m.is_moe:
        assert (o["model.num_moe_experts"], o["model.moe_router_topk"], o["model.moe_ffn_hidden_size"]) == (8, 2, 14336)
        assert (o["model.cpu_offloading"], o["model.cpu_offloading_num_layers"]) == (True, 2)
        assert (o["model.recompute_method"], o["model.recompute_num_layers"]) == ("block", 4)
        assert o["optimizer.optimizer_cpu_offload"] is True


@pytest.mark.parametrize("name", SETUPS)
def test_torchtitan_toml_says_the_setup(name):
    setup, _, c = _export(SETUPS[name], "torchtitan")
    t, p = setup.train, setup.parallel
    assert c["training.seq_len"] == t.seq_len and c["training.global_batch_size"] == setup.global_batch
    # local_batch_size x data-parallel degree x accumulation = global: the micro-batch without PP, the
    # per-rank batch (split into micro-batches of pipeline_parallel_microbatch_size) with it.
    dp = c["parallelism.data_parallel_replicate_degree"] * c["parallelism.data_parallel_shard_degree"]
    assert dp == p.dp
    local = c["training.local_batch_size"]
    if p.pp > 1:
        assert local * dp == setup.global_batch and c["parallelism.pipeline_parallel_microbatch_size"] == t.micro_batch
    else:
        assert local == t.micro_batch and setup.global_batch // (local * dp) == setup.grad_accum
    degrees = ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree")
    assert tuple(c[f"parallelism.{d}"] for d in degrees) == (p.tp, p.pp, p.cp)
    reshard = {0: None, 1: "never", 2: "never", 3: "always"}[p.zero]
    assert c.get("parallelism.fsdp_reshard_after_forward") == reshard
    assert c["training.mixed_precision_param"] == "bfloat16"
    if name == "fsdp-8b":
        assert (c["model.name"], c["model.flavor"]) == ("llama3", "8B")
        assert c["activation_checkpoint.mode"] == "full" and c["parallelism.data_parallel_shard_degree"] == 8
    if name == "70b-tp-pp-cp":
        assert (c["model.flavor"], c["parallelism.pipeline_parallel_schedule"]) == ("70B", "Interleaved1F1B")
        # 80 blocks over 4 x 2 stages: 10 each, the embedding and head not counted as layers.
        assert c["parallelism.pipeline_parallel_layers_per_stage"] == 10
        assert c["parallelism.pipeline_parallel_first_stage_less_layers"] == 0
        assert (c["activation_checkpoint.mode"], c["activation_checkpoint.selective_ac_option"]) == ("selective", "op")
    if name == "moe-ep":
        assert c["model.flavor"] == "custom" and c["parallelism.expert_parallel_degree"] == 8
        assert c["model.converters"] == ["quantize.linear.float8"]
        assert c["quantize.linear.float8.recipe_name"] == t.fp8_recipe == "tensorwise"
        # 4 of each stage's 16 blocks recompute: every 4th block in full.
        assert (c["activation_checkpoint.mode"], c["activation_checkpoint.selective_ac_option"]) == ("selective", "4")


@pytest.mark.parametrize("name", SETUPS)
def test_deepspeed_json_says_the_setup(name):
    setup, out, c = _export(SETUPS[name], "deepspeed")
    t, p = setup.train, setup.parallel
    # DeepSpeed checks train_batch_size = micro x accumulation x its data-parallel ranks (world / tp / pp):
    # the cp ranks are data parallel there (70B: 512 = 1 x 64 x 8, where the setup has 128 x 4).
    ds_dp = setup.gpus // (p.tp * p.pp)
    assert c["train_batch_size"] == c["train_micro_batch_size_per_gpu"] * c["gradient_accumulation_steps"] * ds_dp
    assert (c["train_batch_size"], c["train_micro_batch_size_per_gpu"]) == (setup.global_batch, t.micro_batch)
    assert c["zero_optimization.stage"] == p.zero
    assert c["bf16.enabled"] is True and c["data_types.grad_accum_dtype"] == "fp32"
    assert c.get("tensor_parallel.autotp_size", 1) == p.tp and c.get("pipeline.stages", 1) == p.pp
    assert c.get("zero_optimization.offload_optimizer.device") == ("cpu" if p.offload != "none" else None)
    assert c["optimizer.type"] == "adamw"  # config.py lower-cases the name before its lookup
    if name == "70b-tp-pp-cp":
        assert c["gradient_accumulation_steps"] == 64
    notes = c["_advisor_notes"]
    assert [f"NOTE: {n}" for n in out.notes] == [n for n in notes if n.startswith("NOTE: ")]


@pytest.mark.parametrize("name", SETUPS)
def test_accelerate_yaml_says_the_setup(name):
    setup, out, c = _export(SETUPS[name], "accelerate")
    assert c["num_processes"] == setup.gpus and c["num_machines"] == setup.gpus // 8
    if name == "fsdp-8b":
        assert c["distributed_type"] == "FSDP" and c["mixed_precision"] == "bf16"
        fsdp = {k: c[f"fsdp_config.{k}"] for k in ("fsdp_version", "fsdp_reshard_after_forward")}
        assert fsdp == {"fsdp_version": 2, "fsdp_reshard_after_forward": True}
        assert c["fsdp_config.fsdp_activation_checkpointing"] is True
        assert c["parallelism_config.parallelism_config_dp_shard_size"] == 8
        assert "gradient_accumulation_steps=8)" in out.text
    if name == "70b-tp-pp-cp":
        # No pipeline in Accelerate: the 4 pp ranks join FSDP's shard group, 4 x 4 = 16, so that the
        # degrees still cover the 256 processes.
        size = [c[f"parallelism_config.parallelism_config_{k}_size"] for k in ("dp_replicate", "dp_shard", "tp", "cp")]
        assert size == [1, 16, 8, 2] and size[0] * size[1] * size[2] * size[3] == setup.gpus
        assert "gradient_accumulation_steps=32)" in out.text
    if name == "moe-ep":
        # TP 2 needs FSDP2's parallelism config; FSDP cannot offload the optimizer alone: said, not set.
        assert (c["distributed_type"], c["mixed_precision"], c["fp8_config.backend"]) == ("FSDP", "fp8", "AO")
        assert c["fsdp_config.fsdp_offload_params"] is False
        assert any("FSDP's CPU offload moves parameters" in n for n in out.notes)
        assert "gradient_accumulation_steps=8)" in out.text  # 256 / (micro 1 x 16 dp x 2 pp ranks)


def test_accelerate_takes_the_deepspeed_plugin_for_zero_offload():
    # The optimizer alone in host memory is ZeRO-Offload: the DeepSpeed plugin, not FSDP.
    kw = {"model": "llama-3.1-8b", "gpu": "h100", "gpus": 16, "zero": 1, "offload": "optimizer", "global_batch": 64}
    _, _, c = _export(kw, "accelerate")
    assert (c["distributed_type"], c["num_machines"], c["num_processes"]) == ("DEEPSPEED", 2, 16)
    plugin = {k.split(".")[1]: v for k, v in c.items() if k.startswith("deepspeed_config.")}
    assert plugin == {
        "zero_stage": 1,
        "offload_optimizer_device": "cpu",
        "offload_param_device": "none",
        "gradient_accumulation_steps": 4,  # 64 / (micro 1 x 16 ranks)
    }


# --- where the framework installs on a CPU: its own config classes read the files ------------------

DS_SETUPS = SETUPS | {
    "zero3-param-offload": {
        "model": "llama-3.1-8b",
        "gpu": "h100",
        "gpus": 8,
        "zero": 3,
        "offload": "optimizer+params",
    },
    "fp16-v100": {"model": "gpt2-124m", "gpu": "v100", "gpus": 8, "precision": "fp16", "zero": 2, "global_batch": 64},
}


@pytest.mark.parametrize("name", DS_SETUPS)
def test_deepspeed_reads_the_json_with_its_own_config_class(name, monkeypatch):
    ds = pytest.importorskip("deepspeed.runtime.config", reason="DeepSpeed is not installed (it installs on a CPU)")
    setup, _, c = _export(DS_SETUPS[name], "deepspeed")
    p = setup.parallel
    # No process group here: rank 0 of a data-parallel group of world / (tp x pp), as DeepSpeed's mpu says.
    monkeypatch.setattr(ds.dist, "get_rank", lambda *a, **k: 0)
    mpu = SimpleNamespace(get_data_parallel_world_size=lambda: setup.gpus // (p.tp * p.pp))
    config = ds.DeepSpeedConfig(json.loads(export_setup(setup, "deepspeed").text), mpu=mpu)  # checks the batch
    batch = (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps)
    assert batch == (setup.global_batch, setup.train.micro_batch, c["gradient_accumulation_steps"])
    assert config.zero_optimization_stage == p.zero and config.optimizer_name == "adamw"
    assert (config.bfloat16_config.enabled, config.float16_config.enabled) == (
        setup.train.precision in ("bf16", "fp8"),
        setup.train.precision == "fp16",
    )
    assert config.zero_config.offload_param is None or config.zero_config.offload_param.device == "cpu"


@pytest.mark.parametrize("name", DS_SETUPS)
def test_accelerate_reads_the_yaml_with_its_own_config_class(name, tmp_path):
    config_args = pytest.importorskip("accelerate.commands.config.config_args", reason="Accelerate is not installed")
    from accelerate.parallelism_config import ParallelismConfig

    setup, out, _ = _export(DS_SETUPS[name], "accelerate")
    path = tmp_path / out.filename
    path.write_text(out.text, encoding="utf-8")
    config = config_args.load_config_from_file(str(path))  # a key ClusterConfig lacks fails here
    assert (config.num_processes, config.num_machines) == (setup.gpus, max(1, setup.gpus // 8))
    if config.parallelism_config:
        sizes = {k.removeprefix("parallelism_config_"): v for k, v in config.parallelism_config.items()}
        assert ParallelismConfig(**sizes).total_size == setup.gpus  # the degrees cover every process


# --- what cannot be said is said, what makes no sense is refused -----------------------------------


@pytest.mark.parametrize("framework", EXPORT_TARGETS)
def test_every_note_is_in_the_file(framework):
    _, out, _ = _export(BIG_70B, framework)
    assert out.notes
    for note in out.notes:
        assert note in out.text


def test_what_a_framework_cannot_express_becomes_a_note():
    _, ds, _ = _export(BIG_70B, "deepspeed")
    assert any("no context (ring attention) parallelism" in n and "cp=2" in n for n in ds.notes)
    _, acc, _ = _export(BIG_70B, "accelerate")
    assert any("no pipeline parallelism" in n and "pp=4" in n for n in acc.notes)
    _, titan, _ = _export(MOE, "torchtitan")
    assert any("no activation offload: 2 blocks" in n for n in titan.notes)
    assert any("register a flavor for mixtral-8x7b" in n for n in titan.notes)
    _, meg, _ = _export(FSDP_8B | {"offload": "optimizer+params"}, "megatron")
    assert any("optimizer only: the parameters stay" in n for n in meg.notes)


@pytest.mark.parametrize(
    "kw, framework, message",
    [
        ({"gpu": "cpu", "gpus": 1, "zero": 0}, "megatron", "gpu='cpu': megatron trains on GPUs"),
        ({"optimizer": "adafactor"}, "megatron", "train.optimizer='adafactor': megatron has no adafactor"),
        ({"optimizer": "sgd"}, "torchtitan", "train.optimizer='sgd': torchtitan has no sgd optimizer"),
        ({"recompute": "selective-op"}, "nemo", "train.recompute='selective-op': is torchtitan's op-level"),
        ({"precision": "fp16"}, "torchtitan", "train.precision='fp16': torchtitan trains in bf16, fp8 or fp32"),
        # cp=2 ranks turned data parallel: 8 x 2 x micro 1 = 16 does not divide a global batch of 8.
        ({"gpus": 16, "cp": 2, "global_batch": 8}, "deepspeed", "parallel.cp=2: deepspeed runs these ranks"),
        # Llama-3.1-8B's 8 KV groups over 16 TP ranks: the estimate replicates them, Megatron-Core's
        # attention asserts divide(num_query_groups, tp) (a user review found the launch would crash).
        ({"gpus": 16, "tp": 16}, "megatron", "parallel.tp=16: megatron splits the model's 8 KV groups"),
        ({"gpus": 16, "tp": 16}, "nemo", "parallel.tp=16: nemo splits the model's 8 KV groups"),
    ],
)
def test_a_setup_that_makes_no_sense_for_the_framework_is_refused(kw, framework, message):
    base = {"model": "llama-3.1-8b", "gpu": "h100", "gpus": 8, "zero": 1, "seq": 8192}
    with pytest.raises(SpecError) as err:
        export_setup(make_setup(**(base | kw)), framework)
    assert str(err.value).startswith(message)


def test_an_unknown_framework_names_the_choices():
    with pytest.raises(SpecError, match=r"export\.to='slurm': must be one of megatron, nemo, torchtitan"):
        export_setup(make_setup(), "slurm")


# --- the CLI --------------------------------------------------------------------------------------


def test_cli_export_writes_the_file_and_prints_the_notes(tmp_path, capsys):
    out = tmp_path / "70b.toml"
    argv = ["export", "--to", "torchtitan", "--model", "llama-3.1-70b", "--gpu", "h100", "--gpus", "256"]
    argv += ["--tp", "8", "--pp", "4", "--vpp", "2", "--cp", "2", "--global-batch", "512", "--recompute", "selective"]
    assert main([*argv, "--sp", "--out", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == export_setup(make_setup(**BIG_70B), "torchtitan").text
    err = capsys.readouterr().err
    assert "note: torchtitan has no attention-core-only recompute" in err and f"wrote {out}" in err
    assert main(["export", "--to", "deepspeed", "--model", "llama-3.1-8b", "--gpu", "h100", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["filename"] == "llama-3.1-8b-deepspeed.json"
    assert json.loads(result["text"])["train_batch_size"] == 8  # micro 1 x dp 8, DEFAULTS' 8 GPUs
    assert main(["export", "--to", "megatron", "--model", "llama-3.1-8b", "--recompute", "selective-op"]) == 2
    assert "train.recompute='selective-op'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", "--to", "slurm"])
    assert "invalid choice: 'slurm'" in capsys.readouterr().err


def test_torchtitan_refuses_a_block_its_models_cannot_build():
    # GPT-2's LayerNorm with bias, GELU and learned positions: a llama3 flavor sets sizes only.
    with pytest.raises(SpecError, match="has LayerNorm with bias, a GELU MLP, learned positions; torchtitan's"):
        export_setup(make_setup(model="gpt2-124m", gpu="h100", gpus=8), "torchtitan")
    # Mistral-7B has Llama 3 8B's sizes but its own RoPE base: the flavor is named, with the caveat.
    out = export_setup(make_setup(model="mistral-7b", gpu="h100", gpus=8), "torchtitan")
    assert parse_toml(out.text)["model.flavor"] == "8B"
    assert any("needs a flavor of its own" in n for n in out.notes)


def test_megatron_rope_note_names_no_one_models_values():
    # It once told every model to add Llama 3.1's rotary base 500000 and its RoPE scaling.
    out = export_setup(make_setup(model="llama-2-7b", gpu="h100", gpus=8), "megatron")
    (rope,) = [n for n in out.notes if "RoPE base" in n]
    assert "--rotary-base from its config's rope_theta" in rope and "Llama 3.1: rotary base 500000" not in rope

"""Run llm-analysis (PyPI ``llm-analysis==0.2.2``) training analysis on cases read as JSON from stdin.

Meant to run under the interpreter that has llm-analysis installed (not the project venv), e.g.::

    echo '[{"name": "gpt2", "model": {...}, ...}]' | /tmp/llma/bin/python bench/llm_analysis_runner.py

Imports only llm_analysis and the standard library. Each case is a JSON object:

- ``name``: label echoed back.
- ``model``: ``n_layers``, ``hidden``, ``n_heads``, ``n_kv_heads`` (0 or missing: = n_heads), ``ffn_hidden``,
  ``vocab``, ``gated_mlp`` (SwiGLU: three h x ffn matrices). llm-analysis models every MLP as two matrices
  of ``ffn_embed_dim``, so a gated MLP is passed as ``ffn_embed_dim = 1.5 * ffn_hidden`` (same parameter
  count, as its own shipped Llama-2 config does with 4h) unless ``ffn_embed_dim`` is given explicitly.
- ``gpu``: an llm-analysis GPU config name (``a100-sxm-80gb``, ``h100-sxm-80gb``, ...).
- ``dtype``: llm-analysis dtype config name, default ``w16a16e16``.
- ``seq_len``, ``micro_batch``, ``global_batch`` (0 or missing: micro_batch * dp), ``tp``, ``pp``, ``dp``.
- ``zero``: DeepSpeed ZeRO stage 0-3.
- ``recompute``: ``none`` | ``selective`` | ``full``.
- ``flash_attention``: bool. ``sequence_parallel``: bool (llm-analysis defaults sp_size to tp_size, i.e.
  sequence parallelism on whenever tp > 1; here sp_size is tp_size only when this is true, else 1).
- ``mfu``: llm-analysis' ``flops_efficiency`` (share of peak fp16 TFLOP/s achieved on every FLOP it counts).
- optional ``layernorm_dtype_bytes`` (llm-analysis default 4, fp32).

Prints a JSON list with, per case, the per-GPU memory in bytes (weights, grads, optimizer states, activations,
total) and the step latency in seconds as llm-analysis computes them, plus a few of its intermediate numbers.
A case that llm-analysis rejects comes back as ``{"name": ..., "error": ...}``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the Hugging Face hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

RECOMPUTE = {"none": 0, "selective": 1, "full": 2}


def _run_case(case: dict) -> dict:
    from llm_analysis.analysis import ActivationRecomputation, DSZeRO, LLMAnalysis
    from llm_analysis.config import ModelConfig, ParallelismConfig, get_dtype_config_by_name, get_gpu_config_by_name
    from llm_analysis.constant import BYTES_FP32

    m = case["model"]
    hidden = int(m["hidden"])
    ffn_embed_dim = m.get("ffn_embed_dim") or (
        round(1.5 * m["ffn_hidden"]) if m.get("gated_mlp") else int(m["ffn_hidden"])
    )
    seq = int(case["seq_len"])
    model = ModelConfig(
        name=m.get("name", case.get("name", "model")),
        num_layers=int(m["n_layers"]),
        n_head=int(m["n_heads"]),
        hidden_dim=hidden,
        vocab_size=int(m["vocab"]),
        max_seq_len=max(seq, int(m.get("max_positions", 0) or 0)),
        num_key_value_heads=int(m.get("n_kv_heads") or m["n_heads"]),
        ffn_embed_dim=ffn_embed_dim,
        # Given explicitly: ModelConfig asserts ffn_embed_dim % hidden_dim == 0 when it has to derive it.
        expansion_ratio=ffn_embed_dim / hidden,
    )
    tp, pp, dp = int(case.get("tp", 1)), int(case.get("pp", 1)), int(case.get("dp", 1))
    parallel = ParallelismConfig(tp_size=tp, pp_size=pp, dp_size=dp, sp_size=tp if case.get("sequence_parallel") else 1)
    analysis = LLMAnalysis(
        model,
        get_gpu_config_by_name(case["gpu"]),
        get_dtype_config_by_name(case.get("dtype", "w16a16e16")),
        parallel,
        flops_efficiency=float(case["mfu"]),
    )
    micro = int(case["micro_batch"])
    global_batch = int(case.get("global_batch") or micro * dp)
    recompute = ActivationRecomputation(RECOMPUTE[case.get("recompute", "none")])
    ln_bytes = int(case.get("layernorm_dtype_bytes") or BYTES_FP32)
    s = analysis.training(
        batch_size_per_gpu=micro,
        global_batch_size=global_batch,
        seq_len=seq,
        activation_recomputation=recompute,
        ds_zero=DSZeRO(int(case.get("zero", 0))),
        layernorm_dtype_bytes=ln_bytes,
        flash_attn=bool(case.get("flash_attention", True)),
        mlp_gated_linear_units=bool(m.get("gated_mlp", False)),
    )
    # llm-analysis 0.2.2, training(): with batch_size_per_gpu == 1 it reuses activation_memory_batch_size_1,
    # which already includes the logits and the final norm, then adds both again. Reported, not removed.
    double_counted = 0.0
    if s["batch_size_per_gpu"] == 1:
        double_counted = s["activation_memory_embedding_output_per_gpu"] + analysis.get_activation_memory_per_layernorm(
            1, seq, recompute, ln_bytes
        )
    weights = s["weight_memory_per_gpu"]
    grads = s["gradient_memory_per_gpu"]
    opt = s["optimizer_state_memory_per_gpu"]
    acts = s["activation_memory_per_gpu"]
    return {
        "name": case.get("name", ""),
        "weights_bytes": weights,
        "grads_bytes": grads,
        "optimizer_bytes": opt,
        "activations_bytes": acts,
        "total_bytes": weights + grads + opt + acts,
        "step_time_s": s["latency_per_iter"],
        "details": {
            "ffn_embed_dim": ffn_embed_dim,
            "num_params_total": s["num_params_total"],
            "weight_memory_embedding_bytes": s["weight_memory_embedding_per_gpu"],
            "activation_attn_bytes": s["activation_memory_attn_per_gpu"],
            "activation_mlp_bytes": s["activation_memory_mlp_per_gpu"],
            "activation_layernorm_bytes": s["activation_memory_layernorm_per_gpu"],
            "activation_logits_bytes": s["activation_memory_embedding_output_per_gpu"],
            "activation_double_counted_bytes": double_counted,
            "flops_per_micro_batch": s["num_flops_total_per_micro_batch"],
            "latency_per_micro_batch_s": s["latency_per_micro_batch"],
            "gradient_accumulation_steps": s["gradient_accumulation_steps"],
            "global_batch_size": s["global_batch_size"],
            "sp_size": s["sp_size"],
            "achieved_tflops": s["achieved_flops"],
            "max_batch_size_per_gpu": s["max_batch_size_per_gpu"],
        },
    }


def main() -> int:
    cases = json.load(sys.stdin)
    if isinstance(cases, dict):
        cases = [cases]
    # llm-analysis logs through a StreamHandler and prints banners; keep stdout for the JSON answer.
    with contextlib.redirect_stdout(sys.stderr):
        from llm_analysis.logger import logger

        logger.setLevel(logging.ERROR)
        results = []
        for case in cases:
            try:
                results.append(_run_case(case))
            except (AssertionError, KeyError, TypeError, ValueError, ZeroDivisionError) as exc:  # report, go on
                results.append({"name": case.get("name", ""), "error": f"{type(exc).__name__}: {exc}"})
    json.dump(results, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

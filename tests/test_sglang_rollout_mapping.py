"""The CPU-checkable parts of the sglang rollout: config → engine arguments and sampling parameters,
and the tied-weight rule of the weight sync. The engine itself is exercised in tests/gpu."""
from __future__ import annotations

import dataclasses

import pytest
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybridrl.workers.rollout.sglang_rollout import engine_kwargs, sampling_params
from hybridrl.workers.rollout.weight_sync import tied_parameter_names


def with_engine_kwargs(config, **sglang_kwargs):
    return dataclasses.replace(config, engine_kwargs=dataclasses.replace(config.engine_kwargs, sglang=sglang_kwargs))


def test_engine_kwargs_come_from_the_rollout_keys(engine_rollout_config):
    kwargs = engine_kwargs(engine_rollout_config, "/models/q", gpu_id=3, seed=7)
    assert kwargs == {
        "model_path": "/models/q", "dtype": "bfloat16", "mem_fraction_static": 0.6, "load_format": "dummy",
        "tp_size": 1, "context_length": 130, "max_running_requests": 256, "chunked_prefill_size": 8192,
        "disable_cuda_graph": True, "enable_memory_saver": True, "skip_tokenizer_init": True, "base_gpu_id": 3,
        "random_seed": 7, "attention_backend": "triton", "sampling_backend": "pytorch", "log_level": "error"}


def test_engine_kwargs_sglang_overrides_defaults_but_not_config_owned_keys(engine_rollout_config):
    kwargs = engine_kwargs(with_engine_kwargs(engine_rollout_config, attention_backend="flashinfer",
                                              cuda_graph_max_bs=64),
                           "/models/q", gpu_id=0, seed=0)
    assert kwargs["attention_backend"] == "flashinfer" and kwargs["cuda_graph_max_bs"] == 64
    with pytest.raises(ValueError, match=r"sets \['mem_fraction_static'\].*rollout.gpu_memory_utilization"):
        engine_kwargs(with_engine_kwargs(engine_rollout_config, mem_fraction_static=0.9), "/models/q", gpu_id=0, seed=0)


def test_sampling_params_for_training_validation_and_forced_greedy(engine_rollout_config):
    common = {"max_new_tokens": 28, "ignore_eos": False, "stop_token_ids": [5, 9], "min_p": 0.0,
              "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
    assert sampling_params(engine_rollout_config, {}, [5, 9]) == {**common, "temperature": 0.7, "top_p": 0.9,
                                                                  "top_k": 50}
    greedy = {**common, "temperature": 0.0, "top_p": 1.0, "top_k": -1}
    assert sampling_params(engine_rollout_config, {"validate": True}, [5, 9]) == greedy  # val_kwargs: do_sample false
    assert sampling_params(engine_rollout_config, {"do_sample": False}, [5, 9]) == greedy
    sampled_validation = dataclasses.replace(engine_rollout_config, val_kwargs=dataclasses.replace(
        engine_rollout_config.val_kwargs, do_sample=True, temperature=1.0, top_k=-1, top_p=0.95))
    assert sampling_params(sampled_validation, {"validate": True}, [5]) == {
        **common, "stop_token_ids": [5], "temperature": 1.0, "top_p": 0.95, "top_k": -1}


@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_weight_is_sent_once(tied):
    config = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    model = Qwen2ForCausalLM(config)
    assert tied_parameter_names(model) == ({"lm_head.weight"} if tied else set())

"""Engines sized for their load (issue #26): the peak number of sequences one engine decodes at once under each
schedule, against a hand computation, and the CUDA-graph size the sglang and vllm engine arguments get from it."""
from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest

from hybridrl.config import compose_config, validate_config
from hybridrl.workers.rollout import sglang_rollout, vllm_rollout
from hybridrl.workers.rollout.engine_load import EngineLoad, captured_size, engine_load

ASYNC = ["actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=true"]
SPLIT = ["actor_rollout_ref.hybrid_engine=false", *ASYNC]


def config(*overrides: str):
    return validate_config(compose_config(["data.train_batch_size=64", "actor_rollout_ref.rollout.n=8",
                                           "actor_rollout_ref.actor.ppo_mini_batch_size=16", *overrides]))


def test_colocated_sync_with_two_ranks_splits_the_batch():
    load = engine_load(config("trainer.n_gpus_per_node=2"))
    assert load.peak == 64 * 8 // 2 == 256
    assert load.why == "peak in-flight 256 = 64 prompts x 8 samples on 2 engines"


def test_colocated_tensor_parallel_engine_takes_its_group_s_rows():
    # 4 ranks, TP 2: 2 engines, each decoding the rows of its 2 ranks
    assert engine_load(config("trainer.n_gpus_per_node=4",
                              "actor_rollout_ref.rollout.tensor_model_parallel_size=2")).peak == 64 * 8 // 2


def test_async_agent_loops_spread_the_batch_over_the_engine_servers():
    assert engine_load(config(*ASYNC, "trainer.n_gpus_per_node=2")).peak == 256


@pytest.mark.parametrize("pool_gpus, peak", [(1, 512), (2, 256)])
def test_one_step_off_puts_one_batch_on_the_rollout_pool(pool_gpus, peak):
    load = engine_load(config(*SPLIT, "async_training.mode=one_step_off", f"rollout.n_gpus_per_node={pool_gpus}"))
    assert load.peak == peak
    assert load.why.endswith(f"= 64 prompts x 8 samples on {pool_gpus} engine{'s' if pool_gpus > 1 else ''}")


def test_a_tensor_parallel_engine_on_the_rollout_pool_takes_its_group_s_share():
    # a rollout pool of 4 GPUs in TP groups of 2: 2 engines (sglang's, served by each group's first rank)
    load = engine_load(config(*SPLIT, "async_training.mode=one_step_off", "rollout.n_gpus_per_node=4",
                              "actor_rollout_ref.rollout.tensor_model_parallel_size=2"))
    assert (load.peak, load.why) == (256, "peak in-flight 256 = 64 prompts x 8 samples on 2 engines")


def test_fully_async_keeps_max_staleness_plus_one_batches_in_flight():
    load = engine_load(config(*SPLIT, "async_training.mode=fully_async", "async_training.max_staleness=2",
                              "rollout.n_gpus_per_node=2"))
    assert load.peak == 3 * 64 * 8 // 2 == 768


def test_over_sampling_batch_counts_when_larger():
    assert engine_load(config(*ASYNC, "data_flow.enable=true", "data_flow.over_sampling_batch_size=96",
                              "trainer.n_gpus_per_node=2")).peak == 96 * 8 // 2


def test_a_validation_batch_larger_than_training_sets_the_peak():
    run = config("trainer.n_gpus_per_node=2")  # training: 64 x 8 = 512 sequences, 256 per engine
    assert engine_load(run, val_batches=[(300, 1)]).peak == 256
    assert engine_load(run, val_batches=[(300, 1), (100, 8)]).peak == 100 * 8 // 2 == 400
    assert engine_load(run, val_batches=[(2000, 1)]).why == \
        "peak in-flight 1000 = 2000 validation prompts x 1 samples on 2 engines"


@pytest.mark.parametrize("peak, size", [(1, 1), (3, 4), (8, 8), (9, 16), (250, 256), (256, 256), (257, 272),
                                        (512, 512), (513, 544), (700, 704)])
def test_the_peak_rounds_up_to_a_captured_batch_size(peak, size):
    assert captured_size(peak) == size


# ---------------------------------------------------------------------- what the engines get

def rollout_config(*overrides: str, **engine_kwargs):
    rollout = config("actor_rollout_ref.rollout.enforce_eager=false", *overrides).actor_rollout_ref.rollout
    return dataclasses.replace(rollout, engine_kwargs=dataclasses.replace(rollout.engine_kwargs, **engine_kwargs))


LOAD = EngineLoad(500, "peak in-flight 500 = 64 prompts x 8 samples on 1 engine")  # rounds up to 512


def sglang_kwargs(rollout, load=LOAD):
    return sglang_rollout.engine_kwargs(rollout, "/m", gpu_id=0, seed=0, load=load)


def vllm_kwargs(rollout, load=LOAD):
    return vllm_rollout.engine_kwargs(rollout, "/m", seed=0, load=load)


def test_sglang_captures_decode_graphs_up_to_the_peak_and_logs_why(caplog):
    with caplog.at_level(logging.INFO, logger="hybridrl.workers.rollout.engine_load"):
        kwargs = sglang_kwargs(rollout_config())
    assert kwargs["cuda_graph_max_bs_decode"] == 512 and kwargs["disable_cuda_graph"] is False
    assert "sglang: cuda_graph_max_bs_decode=512 (peak in-flight 500 = 64 prompts x 8 samples on 1 engine)" \
        in caplog.messages


def test_vllm_captures_graphs_up_to_the_peak_and_keeps_the_user_s_compilation_config():
    assert vllm_kwargs(rollout_config())["compilation_config"] == {"max_cudagraph_capture_size": 512}
    kwargs = vllm_kwargs(rollout_config(vllm={"compilation_config": {"mode": 3}}))
    assert kwargs["compilation_config"] == {"mode": 3, "max_cudagraph_capture_size": 512}


def test_full_determinism_keeps_vllm_s_inductor_from_timing_combo_kernels():
    """torch.use_deterministic_algorithms puts Inductor in its deterministic mode, which raises on vLLM's default
    combo-kernel timing (the GPU gate's first vLLM runs, 2026-12-06): the flag goes to vLLM off, the user's own wins."""
    on = "actor_rollout_ref.rollout.full_determinism=true"
    assert vllm_kwargs(rollout_config(on))["compilation_config"] == {
        "max_cudagraph_capture_size": 512, "inductor_compile_config": {"benchmark_combo_kernel": False}}
    user = {"compilation_config": {"inductor_compile_config": {"benchmark_combo_kernel": True, "x": 1}}}
    assert vllm_kwargs(rollout_config(on, vllm=user))["compilation_config"]["inductor_compile_config"] == \
        {"benchmark_combo_kernel": True, "x": 1}
    assert "inductor_compile_config" not in vllm_kwargs(rollout_config())["compilation_config"]


def test_the_size_is_capped_at_max_num_seqs(caplog):
    with caplog.at_level(logging.INFO, logger="hybridrl.workers.rollout.engine_load"):
        kwargs = sglang_kwargs(rollout_config("actor_rollout_ref.rollout.max_num_seqs=384"))
    assert kwargs["cuda_graph_max_bs_decode"] == 384
    assert "capped at rollout.max_num_seqs=384" in caplog.messages[-1]
    assert vllm_kwargs(rollout_config("actor_rollout_ref.rollout.max_num_seqs=384"))["compilation_config"] == \
        {"max_cudagraph_capture_size": 384}


def test_the_user_s_engine_kwargs_value_wins(caplog):
    with caplog.at_level(logging.INFO, logger="hybridrl.workers.rollout.engine_load"):
        kwargs = sglang_kwargs(rollout_config(sglang={"cuda_graph_max_bs": 64}))
    assert kwargs["cuda_graph_max_bs"] == 64 and "cuda_graph_max_bs_decode" not in kwargs
    assert "rollout.engine_kwargs.sglang (cuda_graph_max_bs)" in caplog.messages[-1]
    assert sglang_kwargs(rollout_config(sglang={"cuda_graph_max_bs_decode": 128}))["cuda_graph_max_bs_decode"] == 128
    user = {"compilation_config": {"cudagraph_capture_sizes": [1, 2, 4]}}
    assert vllm_kwargs(rollout_config(vllm=user))["compilation_config"] == {"cudagraph_capture_sizes": [1, 2, 4]}
    assert vllm_kwargs(rollout_config(vllm={"compilation_config": 3}))["compilation_config"] == 3  # a bare mode


def test_enforce_eager_leaves_no_graph_setting():
    eager = rollout_config("actor_rollout_ref.rollout.enforce_eager=true")
    kwargs = sglang_kwargs(eager)
    assert kwargs["disable_cuda_graph"] is True and "cuda_graph_max_bs_decode" not in kwargs
    kwargs = vllm_kwargs(eager)
    assert kwargs["enforce_eager"] is True and "compilation_config" not in kwargs


def test_no_load_given_leaves_the_engine_defaults():
    assert "cuda_graph_max_bs_decode" not in sglang_kwargs(rollout_config(), load=None)
    assert "compilation_config" not in vllm_kwargs(rollout_config(), load=None)


def test_the_trainer_counts_its_largest_validation_batch():
    """RayPPOTrainer.rollout_engine_load: the validation loader's batch x val_kwargs.n, each eval set's batch x its n
    (a loader's batch is at most its dataset)."""
    from torch.utils.data import DataLoader

    from hybridrl.trainer.ppo.ray_trainer import RayPPOTrainer

    run = config("trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.val_kwargs.n=2")
    trainer = SimpleNamespace(config=run, val_dataloader=DataLoader(range(300), batch_size=300),
                              eval_sets=[(SimpleNamespace(n=16), DataLoader(range(50), batch_size=1000))])
    assert RayPPOTrainer.rollout_engine_load(trainer).peak == 50 * 16 // 2 == 400
    trainer.eval_sets = []
    assert RayPPOTrainer.rollout_engine_load(trainer).peak == 300 * 2 // 2 == 300


def test_build_rollout_hands_the_load_to_the_vllm_engine(monkeypatch):
    from test_vllm_rollout import FakeDevice, FakeLLM

    from hybridrl.models.spec import ModelSpec
    from hybridrl.workers.rollout.base import build_rollout

    device = FakeDevice()
    monkeypatch.setattr(vllm_rollout, "load_vllm", lambda: SimpleNamespace(
        LLM=type("LLM", (FakeLLM,), {"device": device}), SamplingParams=dict))
    monkeypatch.setattr(vllm_rollout, "DeviceMemory", lambda: device)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    rollout = build_rollout(dataclasses.replace(rollout_config(), name="vllm"),
                            ModelSpec(key="actor_rollout_ref.model", path="/no/such/model"), engine_load=LOAD)
    assert rollout.llm.kwargs["compilation_config"] == {"max_cudagraph_capture_size": 512}
    assert rollout.engine_kwargs["compilation_config"] == {"max_cudagraph_capture_size": 512}


def test_a_peak_above_max_num_seqs_warns_naming_both_keys():
    from hybridrl.workers.rollout.config_checks import _engine_load_fits_max_num_seqs

    run = config(*SPLIT, "async_training.mode=one_step_off", "actor_rollout_ref.rollout.max_num_seqs=256")
    assert _engine_load_fits_max_num_seqs(run) == [
        "actor_rollout_ref.rollout.max_num_seqs=256 is below the 512 sequences the schedule puts on one engine at "
        "once (peak in-flight 512 = 64 prompts x 8 samples on 1 engine; data.train_batch_size=64, "
        "actor_rollout_ref.rollout.n=8): the rest queue until a sequence finishes; raise "
        "actor_rollout_ref.rollout.max_num_seqs to 512 to run them together"]
    assert _engine_load_fits_max_num_seqs(config(*SPLIT, "async_training.mode=one_step_off")) == []  # 1024
    sync_hf = config("actor_rollout_ref.rollout.max_num_seqs=8")  # the hf batch call has no such cap
    assert _engine_load_fits_max_num_seqs(sync_hf) == []

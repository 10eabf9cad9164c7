"""models/flops.py against a hand count, and the MFU arithmetic (CPU: no peak, so no MFU)."""
import pytest
from transformers import LlamaConfig, Qwen2Config

from hybridrl.models.flops import dense_parameters, forward_flops, model_flops_utilization, peak_flops_of, supports
from hybridrl.models.memory import memory_metrics

# hidden 8, 2 heads of 4, 1 kv head, MLP 16, 3 layers, vocabulary 10
CONFIG = Qwen2Config(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, intermediate_size=16,
                     num_hidden_layers=3, vocab_size=10)


def test_dense_parameters_by_hand():
    q, k, v, o = 8 * 8, 8 * 4, 8 * 4, 8 * 8  # k and v are one head of 4 (GQA)
    mlp = 3 * 8 * 16                          # gate, up, down
    lm_head = 10 * 8                          # the embedding lookup is not a matmul
    assert dense_parameters(CONFIG) == 3 * (q + k + v + o + mlp) + lm_head == 1808


def test_forward_flops_by_hand_counts_each_sequence_square_apart():
    # 2 FLOPs per weight per token; QK^T and PV: 2 x 2 x len^2 x head_dim per head and layer, per sequence
    expected = 2 * 1808 * (3 + 5) + 4 * 3 * 2 * 4 * (3 ** 2 + 5 ** 2)
    assert forward_flops(CONFIG, [3, 5]) == expected == 32192
    assert forward_flops(CONFIG, [8]) > forward_flops(CONFIG, [3, 5])  # one sequence of 8 attends more


def test_peaks_by_device_name_and_no_mfu_without_one():
    assert peak_flops_of("NVIDIA H100 80GB HBM3") == pytest.approx(989.4e12)
    assert peak_flops_of("NVIDIA A100-SXM4-80GB") == pytest.approx(312e12)
    assert peak_flops_of("NVIDIA GeForce GTX 1080") is None
    assert model_flops_utilization(CONFIG, [3, 5], 1.0, "cpu", passes=3) is None
    assert supports(CONFIG) and supports(LlamaConfig(hidden_size=8, num_attention_heads=2, intermediate_size=16,
                                                     num_hidden_layers=1, vocab_size=10))


def test_cpu_memory_metric_is_reported_without_cuda():
    metrics = memory_metrics("cpu")
    assert set(metrics) == {"perf/cpu_memory_used_gb"} and 0 < metrics["perf/cpu_memory_used_gb"] < 1e4


def test_cuda_peaks_leave_out_what_an_in_process_engine_keeps_allocated(monkeypatch):
    """torch's CUDA peaks count a sleeping vLLM engine's tensors (its CuMem pool keeps them allocated); the trainer's
    peaks are those less the rollout's allocator_bytes. torch.cuda is the boundary faked here (no GPU on CPU CI)."""
    import torch

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 150 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 159 * gib)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: None)
    metrics = memory_metrics("cuda", engine_bytes=66 * gib)
    assert metrics["perf/max_memory_allocated_gb"] == 84.0 and metrics["perf/max_memory_reserved_gb"] == 93.0
    assert memory_metrics("cuda")["perf/max_memory_allocated_gb"] == 150.0

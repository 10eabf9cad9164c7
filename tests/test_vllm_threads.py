"""The vllm rollout's torch threads (`rollout.torch_threads`): null takes the node's CPUs per GPU as Ray counts them.

A real local Ray, started here with CPUs and GPUs declared (Ray takes a declared GPU count as is, so no GPU is needed):
the count must come from the node's resources as Ray holds them, not from the machine the test runs on."""
from __future__ import annotations

import os

import pytest
import ray
import torch

from hybridrl.workers.rollout.vllm_rollout import node_cpus_per_gpu


@pytest.fixture
def declared_ray():
    """A Ray of 6 CPUs and 2 GPUs on this machine, whatever it has; shut down after the test."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=6, num_gpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def test_outside_ray_the_cpus_this_process_may_use_over_the_gpus_torch_sees():
    assert node_cpus_per_gpu() == max(1, len(os.sched_getaffinity(0)) // max(1, torch.cuda.device_count()))


def test_inside_ray_the_nodes_cpus_per_gpu_as_ray_counts_them(declared_ray):
    # in a task, as the rollout worker reads it: 6 declared CPUs over 2 declared GPUs
    assert ray.get(ray.remote(num_cpus=1)(node_cpus_per_gpu).remote()) == 3
    assert node_cpus_per_gpu() == 3  # the driver of that Ray sees the same node

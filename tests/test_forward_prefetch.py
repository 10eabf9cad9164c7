"""fsdp_config.forward_prefetch: the next decoder layer's all-gather is issued early (FSDP1's flag, FSDP2's
set_modules_to_forward_prefetch); the numbers stay exactly those of the run without it. One gloo rank."""
import pytest
import torch
import torch.distributed as dist

from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer
from hybridrl.models.fsdp_utils import load_hf_model, shard_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tokenizer = build_tokenizer(["the cat sat on the mat", "one two three four"] * 20, vocab_size=96)
    return build_tiny_model(str(tmp_path_factory.mktemp("prefetch")), tokenizer, hidden_size=32, num_layers=3,
                            num_heads=4, num_kv_heads=2, intermediate_size=64)


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg_init", rank=0, world_size=1)
    yield "cpu"
    dist.destroy_process_group()


def logits(module, input_ids):
    with torch.no_grad():
        return module(input_ids=input_ids).logits


def prefetched_by(layer) -> list:
    return list(layer._get_fsdp_state()._states_to_forward_prefetch)


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_forward_prefetch_keeps_the_numbers(one_rank, model_dir, strategy):
    input_ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    plain = shard_model(load_hf_model(model_dir), strategy=strategy, device=one_rank, mixed_precision=False)
    prefetching = shard_model(load_hf_model(model_dir), strategy=strategy, device=one_rank, mixed_precision=False,
                              forward_prefetch=True)
    assert torch.equal(logits(prefetching, input_ids), logits(plain, input_ids))
    if strategy == "fsdp":
        assert prefetching.forward_prefetch and not plain.forward_prefetch
        return
    layers = list(prefetching.model.layers)  # the FSDP2 units, in forward order
    assert len(layers) == 3
    assert [len(prefetched_by(layer)) for layer in layers] == [1, 1, 0]  # each layer gathers the next one
    assert prefetched_by(layers[0])[0] is layers[1]._get_fsdp_state()
    assert all(prefetched_by(layer) == [] for layer in plain.model.layers)

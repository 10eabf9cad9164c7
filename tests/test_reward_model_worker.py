"""RewardModelWorker on a real local Ray: 2 CPU ranks over gloo, FSDP2, tiny Qwen2ForSequenceClassification
reward models saved to disk, scores checked against a single-process HF forward of the unpadded text.

One colocated group (one process per rank) holds three roles, each given the policy's tokenizer as the controller
hands it over:
  same     the RM shares the policy's tokenizer and chat template: it reads the policy's token ids
  switch   the RM has its own vocabulary and chat template: every row is re-tokenised from its chat
  dynamic  an RM of an architecture only its reward_model.model.external_lib registers, scoring in token-budget
           micro-batches (reward_model.use_dynamic_bsz with forward_max_token_len_per_gpu)
"""
import sys

import pytest
import ray
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, Qwen2Config, Qwen2ForSequenceClassification

from hybridrl.config.compose import compose_config
from hybridrl.config.validation import validate_config
from hybridrl.protocol import DataProto
from hybridrl.single_controller import Dispatch, register
from hybridrl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, \
    create_colocated_worker_cls
from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer
from hybridrl.utils.import_utils import load_extensions
from hybridrl.models.spec import ModelSpec, reward_model_spec
from hybridrl.workers.reward_model import RewardModelWorker, load_reward_model, same_tokenization

# Ray workers cannot import this test module by name; ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

PROMPT_LENGTH, RESPONSE_LENGTH = 20, 8
QUESTIONS = ["what is 3 + 4 ?", "name a colour", "2 + 2 ?", "say hello", "count to 3"]
RESPONSES = ["7<|im_end|>", "the sky is blue", "4", "hello there friend<|im_end|>", "1 2 3"]
POLICY_TEXTS = QUESTIONS * 10 + RESPONSES * 10 + ["user assistant"] * 10
# The switch RM's own chat template, written differently from ChatML on purpose.
RM_TEMPLATE = "{% for m in messages %}{{ '[' + m['role'] + ']: ' + m['content'] + '\n' }}{% endfor %}"
# reward_model.model.external_lib of the dynamic RM: registers its architecture with transformers' Auto classes;
# without the import, AutoConfig does not know the model_type its config.json names.
EXTERNAL_LIB = '''
from transformers import (AutoConfig, AutoModel, AutoModelForSequenceClassification, Qwen2Config,
                          Qwen2ForSequenceClassification, Qwen2Model)


class ProbeRewardConfig(Qwen2Config):
    model_type = "hybridrl_probe_reward"


class ProbeRewardBackbone(Qwen2Model):
    config_class = ProbeRewardConfig


class ProbeRewardModel(Qwen2ForSequenceClassification):
    config_class = ProbeRewardConfig


AutoConfig.register("hybridrl_probe_reward", ProbeRewardConfig)
AutoModel.register(ProbeRewardConfig, ProbeRewardBackbone)  # the classification head builds its backbone through it
AutoModelForSequenceClassification.register(ProbeRewardConfig, ProbeRewardModel)
'''
TOKEN_BUDGET = 40  # reward_model.forward_max_token_len_per_gpu of the dynamic RM


class RecordingRewardModel(RewardModelWorker):
    """The worker under test plus a record of the rows (their attended token ids) each forward received."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.forwards = []

    def _scores(self, input_ids, attention_mask, position_ids):
        self.forwards.append([ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)])
        return super()._scores(input_ids, attention_mask, position_ids)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def take_forwards(self) -> list[list[list[int]]]:
        forwards, self.forwards = self.forwards, []
        return forwards


def save_reward_model(out_dir, tokenizer, seed):
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    Qwen2ForSequenceClassification(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    policy_tokenizer = build_tokenizer(POLICY_TEXTS, vocab_size=330)
    policy_dir = tmp_path_factory.mktemp("policy")
    policy_tokenizer.save_pretrained(policy_dir)
    rm_tokenizer = build_tokenizer(["[user]: [assistant]: hello blue sky"] * 10 + QUESTIONS, vocab_size=290)
    rm_tokenizer.chat_template = RM_TEMPLATE
    external_lib = tmp_path_factory.mktemp("external_lib") / "probe_reward_arch.py"
    external_lib.write_text(EXTERNAL_LIB)
    load_extensions([str(external_lib)])  # here too, to build the RM of that architecture and score it directly
    dynamic_dir = tmp_path_factory.mktemp("rm_dynamic")
    torch.manual_seed(3)
    AutoModelForSequenceClassification.from_config(AutoConfig.for_model(
        "hybridrl_probe_reward", vocab_size=len(policy_tokenizer), hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256, num_labels=1,
        pad_token_id=policy_tokenizer.pad_token_id, eos_token_id=policy_tokenizer.eos_token_id,
    )).save_pretrained(dynamic_dir)
    policy_tokenizer.save_pretrained(dynamic_dir)
    return {"policy_dir": str(policy_dir), "policy_tokenizer": policy_tokenizer, "rm_tokenizer": rm_tokenizer,
            "same_dir": save_reward_model(tmp_path_factory.mktemp("rm_same"), policy_tokenizer, seed=1),
            "switch_dir": save_reward_model(tmp_path_factory.mktemp("rm_switch"), rm_tokenizer, seed=2),
            "dynamic_dir": str(dynamic_dir), "external_lib": str(external_lib)}


def rm_config(policy_dir, rm_dir, *overrides):
    config = validate_config(compose_config([
        f"actor_rollout_ref.model.path={policy_dir}", "data.train_files=unused.parquet", "data.val_files=unused.parquet",
        f"reward_model.model.path={rm_dir}", "reward_model.micro_batch_size_per_gpu=2", "reward_model.max_length=64",
        "trainer.n_gpus_per_node=2", *overrides]))
    return config.reward_model, reward_model_spec(config)


@pytest.fixture(scope="module")
def groups(ray_local, models):
    dynamic = [f"reward_model.model.external_lib={models['external_lib']}", "reward_model.use_dynamic_bsz=true",
               f"reward_model.forward_max_token_len_per_gpu={TOKEN_BUDGET}"]
    common = {"seed": 0, "device": "cpu", "policy_tokenizer": models["policy_tokenizer"]}
    roles = {name: RayClassWithInitArgs(RewardModelWorker, *rm_config(models["policy_dir"], models[f"{name}_dir"]),
                                        **common)
             for name in ("same", "switch")}
    roles["dynamic"] = RayClassWithInitArgs(RecordingRewardModel,
                                            *rm_config(models["policy_dir"], models["dynamic_dir"], *dynamic), **common)
    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, name_prefix="test_rm")
    spawned = RayWorkerGroup(pool, create_colocated_worker_cls(roles)).spawn(prefix_set=set(roles))
    for group in spawned.values():
        group.init_model()
    yield spawned
    pool.remove()


def policy_batch(tokenizer) -> DataProto:
    """Five rollout rows as the trainer holds them: left-padded chat prompts, right-padded responses, raw chats."""
    chats = [[{"role": "user", "content": question}] for question in QUESTIONS]
    ids, masks, responses = [], [], []
    for chat, response in zip(chats, RESPONSES):
        prompt = tokenizer(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                           add_special_tokens=False)["input_ids"]
        answer = tokenizer(response, add_special_tokens=False)["input_ids"]
        assert len(prompt) <= PROMPT_LENGTH and len(answer) <= RESPONSE_LENGTH
        left, right = PROMPT_LENGTH - len(prompt), RESPONSE_LENGTH - len(answer)
        pad = tokenizer.pad_token_id
        ids.append([pad] * left + prompt + answer + [pad] * right)
        masks.append([0] * left + [1] * (len(prompt) + len(answer)) + [0] * right)
        responses.append(answer + [pad] * right)
    mask = torch.tensor(masks)
    input_ids = torch.tensor(ids)
    return DataProto.from_dict(
        {"input_ids": input_ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
         "prompts": input_ids[:, :PROMPT_LENGTH], "responses": torch.tensor(responses)},
        {"raw_prompt": chats})


def direct_scores(model_dir, token_lists) -> list[float]:
    """Single process, no padding: the score head at the last token of each unpadded sequence."""
    from test_scale_features_e2e import score_at_last_token

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    return [score_at_last_token(model, torch.tensor([tokens])) for tokens in token_lists]


def expected_rm_scores(scores, tokenizer) -> torch.Tensor:
    """Each score on its response's last valid token (EOS included when the response has one), 0 elsewhere."""
    expected = torch.zeros(len(RESPONSES), RESPONSE_LENGTH)
    for row, (score, response) in enumerate(zip(scores, RESPONSES)):
        expected[row, len(tokenizer(response, add_special_tokens=False)["input_ids"]) - 1] = score
    return expected


def test_same_tokenizer_scores_the_policy_tokens(groups, models):
    tokenizer = models["policy_tokenizer"]
    batch = policy_batch(tokenizer)
    rm_scores = groups["same"].compute_rm_score(batch).batch["rm_scores"]

    unpadded = [row[mask.bool()].tolist() for row, mask in zip(batch.batch["input_ids"], batch.batch["attention_mask"])]
    expected = expected_rm_scores(direct_scores(models["same_dir"], unpadded), tokenizer)
    assert rm_scores.shape == (5, RESPONSE_LENGTH) and rm_scores.dtype == torch.float32
    assert (rm_scores != 0).sum() == 5
    torch.testing.assert_close(rm_scores, expected, atol=1e-5, rtol=0)


def test_a_response_ending_in_the_pad_id_is_scored_at_that_token(groups, models):
    """The score goes on the last attended token, as verl's worker reads it (eos_mask_idx), even when a sampled
    response ends in the pad id, where HF's sequence-classification pooling would read the token before."""
    tokenizer = models["policy_tokenizer"]
    batch = policy_batch(tokenizer)
    last = batch.batch["attention_mask"][:, PROMPT_LENGTH:].sum(-1) - 1
    rows = torch.arange(len(last))
    batch.batch["responses"][rows, last] = tokenizer.pad_token_id
    batch.batch["input_ids"][rows, PROMPT_LENGTH + last] = tokenizer.pad_token_id
    rm_scores = groups["same"].compute_rm_score(batch).batch["rm_scores"]

    unpadded = [row[mask.bool()] for row, mask in zip(batch.batch["input_ids"], batch.batch["attention_mask"])]
    expected = expected_rm_scores(direct_scores(models["same_dir"], [row.tolist() for row in unpadded]), tokenizer)
    torch.testing.assert_close(rm_scores, expected, atol=1e-5, rtol=0)
    model = AutoModelForSequenceClassification.from_pretrained(models["same_dir"], dtype=torch.float32)
    with torch.no_grad():
        pooled = torch.tensor([model(input_ids=row.unsqueeze(0)).logits[0, 0].item() for row in unpadded])
    assert ((rm_scores[rows, last] - pooled).abs() > 1e-3).all()


def test_other_tokenizer_and_template_rescore_the_chat(groups, models):
    rm_tokenizer = models["rm_tokenizer"]
    rm_scores = groups["switch"].compute_rm_score(policy_batch(models["policy_tokenizer"])).batch["rm_scores"]

    # The RM's template written out by hand; the response is decoded without its EOS.
    texts = [f"[user]: {question}\n[assistant]: {response.removesuffix('<|im_end|>')}\n"
             for question, response in zip(QUESTIONS, RESPONSES)]
    rm_ids = [rm_tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    expected = expected_rm_scores(direct_scores(models["switch_dir"], rm_ids), models["policy_tokenizer"])
    torch.testing.assert_close(rm_scores, expected, atol=1e-5, rtol=0)
    assert not torch.allclose(rm_scores, groups["same"].compute_rm_score(
        policy_batch(models["policy_tokenizer"])).batch["rm_scores"])


def test_retokenizing_needs_the_raw_chat(groups, models):
    batch = policy_batch(models["policy_tokenizer"])
    batch.pop(non_tensor_batch_keys=["raw_prompt"])
    with pytest.raises(Exception, match="data.return_raw_chat=true"):
        groups["switch"].compute_rm_score(batch)


def test_tokenizer_comparison_and_untrained_head_refused(models, tmp_path):
    policy, rm = models["policy_tokenizer"], models["rm_tokenizer"]
    assert same_tokenization(policy, policy) and not same_tokenization(policy, rm)
    retemplated = build_tokenizer(POLICY_TEXTS, vocab_size=330)
    retemplated.chat_template = RM_TEMPLATE
    assert retemplated.get_vocab() == policy.get_vocab() and not same_tokenization(policy, retemplated)

    causal_lm = build_tiny_model(str(tmp_path / "lm"), policy, hidden_size=32, num_layers=1, intermediate_size=64)
    with pytest.raises(ValueError, match=r"^reward_model\.model\.path=.* is not a trained reward model.*score\.weight"):
        load_reward_model(ModelSpec(key="reward_model.model", path=causal_lm), torch.float32)


def test_external_lib_and_token_budget_micro_batches(groups, models):
    """reward_model.model.external_lib is imported before the model loads (its architecture is known only through
    it); with use_dynamic_bsz each forward holds at most forward_max_token_len_per_gpu attended tokens, the rows
    grouped by length, and the scores come back in row order."""
    batch = policy_batch(models["policy_tokenizer"])
    unpadded = [row[mask.bool()].tolist() for row, mask in zip(batch.batch["input_ids"], batch.batch["attention_mask"])]
    assert [len(tokens) for tokens in unpadded] == [20, 17, 16, 16, 19]
    rm_scores = groups["dynamic"].compute_rm_score(batch).batch["rm_scores"]
    expected = expected_rm_scores(direct_scores(models["dynamic_dir"], unpadded), models["policy_tokenizer"])
    torch.testing.assert_close(rm_scores, expected, atol=1e-5, rtol=0)

    # 5 rows on 2 ranks: padded with a copy of row 0, rank 0 holds rows 0, 1, 2 (20, 17, 16 tokens), rank 1 rows 3,
    # 4, 0 (16, 19, 20). Each needs ceil(53 / 40) = ceil(55 / 40) = 2 forwards; balanced, the longest row goes alone
    # and the other two share one (33 and 35 tokens). micro_batch_size_per_gpu=2 would have cut [0, 1] [2] instead.
    forwards = groups["dynamic"].take_forwards()
    rows_per_forward = [sorted(sorted(unpadded.index(tokens) for tokens in forward) for forward in rank)
                        for rank in forwards]
    assert rows_per_forward == [[[0], [1, 2]], [[0], [3, 4]]]
    for rank in forwards:
        assert all(sum(len(tokens) for tokens in forward) <= TOKEN_BUDGET for forward in rank)

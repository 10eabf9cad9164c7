"""A built-in task where tool use is learned on a CPU: two-digit multiplication with a `calculator` tool.

    python -m hybridrl.defaults.tool_task [--cache_dir DIR]     # build data + tiny model + warm start (cached)
    python -m hybridrl.main_ppo --config-name tool_default       # GRPO with the tool_agent loop on it

"What is 47*86?" A tiny model (~1M parameters) cannot multiply two-digit numbers, but it can copy: ask the
calculator (`<tool_call>{"name": "calculator", "arguments": {"expression": "47*86"}}</tool_call>`) and copy
the tool's answer into "The answer is 4042.". The reward (scorer `hybridrl/arithmetic_tool`) is 1 for the
right final number, 0 otherwise, however it was found.

The warm start is a short SFT (plain PyTorch here, on exactly the token layout the tool_agent loop builds: the
prompt rendered with the tools, the model's turns ending in EOS, tool deltas masked out of the loss) on
conversations that use the tool for a minority `tool_fraction` of the questions and otherwise answer directly
(with the right number, which the model cannot learn to compute), plus copy drills: tool conversations for the
other questions whose choice token is out of the loss (`warm_start_conversations` says why). So after SFT the model
knows how to use the tool but rarely chooses to: greedy decoding answers directly and is wrong, sampling calls the
tool about tool_fraction of the time and those answers are mostly right, and GRPO moves the choice to the tool
(see the embedded default in assets.py for why a clear minority, not half).

Stages, cached under `$HYBRIDRL_CACHE_DIR` (else ~/.cache/hybridrl) in data/arithmetic_tool and
models/arithmetic_tool_sft, each rebuilt when missing or of another recipe (the marker file records it).
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from dataclasses import dataclass

from hybridrl.defaults.assets import build_stage, model_dir_problem

DATA_SOURCE = "hybridrl/arithmetic_tool"
TOOL_CONFIG = os.path.join(os.path.dirname(__file__), "arithmetic_tool_config.yaml")
TOOL_SCHEMAS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluates an arithmetic expression exactly, e.g. \"123*456\".",
    "parameters": {"type": "object", "properties": {"expression": {
        "type": "string", "description": "integers, + - * / // % ** and parentheses"}}, "required": ["expression"]}}}]


@dataclass
class ToolTaskRecipe:
    train_size: int = 2000
    test_size: int = 128
    low: int = 10                 # operands are drawn from [low, high]
    high: int = 99
    tool_fraction: float = 0.25   # share of warm-start conversations that call the calculator
    copy_drills: bool = True      # tool conversations with the choice token out of the loss (see warm_start_conversations)
    seed: int = 0
    vocab_size: int = 400
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    sft_steps: int = 600
    sft_batch_size: int = 32
    sft_lr: float = 3e-3


def question(a: int, b: int) -> str:
    return f"What is {a}*{b}?"


def tool_call_text(a: int, b: int) -> str:
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "%d*%d"}}</tool_call>' % (a, b)


def answer_text(value: int) -> str:
    return f"The answer is {value}."


def make_rows(recipe: ToolTaskRecipe) -> tuple[list[dict], list[dict]]:
    """RL rows (verl's layout, agent_name=tool_agent), train and test with disjoint questions."""
    rng = random.Random(recipe.seed)
    pairs = [(a, b) for a in range(recipe.low, recipe.high + 1) for b in range(recipe.low, recipe.high + 1)]
    rng.shuffle(pairs)
    test, train = pairs[:recipe.test_size], pairs[recipe.test_size:recipe.test_size + recipe.train_size]

    def rows(split, chosen):
        return [{"data_source": DATA_SOURCE, "agent_name": "tool_agent",
                 "prompt": [{"role": "user", "content": question(a, b)}],
                 "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a * b)},
                 "extra_info": {"split": split, "index": i, "a": a, "b": b}}
                for i, (a, b) in enumerate(chosen)]
    return rows("train", train), rows("test", test)


def warm_start_conversations(rl_rows: list[dict], tool_fraction: float, copy_drills: bool = True) -> list[list[dict]]:
    """The SFT conversations: round(tool_fraction * n) rows, spread evenly, call the calculator; the rest answer
    directly. With copy_drills, every direct row also comes as a tool conversation whose first reply token (the
    choice between "<tool_call>" and "The answer") is left out of the loss.

    Why the drills: the choice is what RL should change, so only a minority of the data may teach it; but the
    copying the tool needs (the operands into the call, the tool's number into the answer) is what a ~1M-parameter
    model learns slowly. Trained on the minority alone, the warm start called the tool in 23 % of sampled answers
    and got 3 % of those right (it miscopied digits), so GRPO saw almost no reward and the greedy answer flipped
    to the tool late and at a varying step. The drills teach copying on every question without teaching the
    choice."""
    conversations = []
    for position, row in enumerate(rl_rows):
        a, b = row["extra_info"]["a"], row["extra_info"]["b"]
        uses_tool = int((position + 1) * tool_fraction) > int(position * tool_fraction)
        if uses_tool or copy_drills:
            conversations.append(list(row["prompt"]) + [
                {"role": "assistant", "content": tool_call_text(a, b), "choice_in_loss": uses_tool},
                {"role": "tool", "content": str(a * b)}, {"role": "assistant", "content": answer_text(a * b)}])
        if not uses_tool:
            conversations.append(list(row["prompt"]) + [{"role": "assistant", "content": answer_text(a * b)}])
    return conversations


def conversation_tokens(tokenizer, messages: list[dict], tools=TOOL_SCHEMAS) -> tuple[list[int], list[int]]:
    """(ids, loss mask) in the tool_agent loop's layout: the prompt as one rendering, each assistant turn as its
    content's tokens + EOS (mask 1; the turn's first token 0 where the message says "choice_in_loss": False),
    each run of tool messages as the template delta (mask 0)."""
    def render(part, generation_prompt):
        return tokenizer.apply_chat_template(part, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    first_reply = next(i for i, message in enumerate(messages) if message["role"] == "assistant")
    ids = encode(render(messages[:first_reply], True))
    mask = [0] * len(ids)
    position = first_reply
    while position < len(messages):
        content = encode(messages[position]["content"]) + [tokenizer.eos_token_id]
        content_mask = [1] * len(content)
        if not messages[position].get("choice_in_loss", True):
            content_mask[0] = 0
        ids, mask, position = ids + content, mask + content_mask, position + 1
        tools_end = position
        while tools_end < len(messages) and messages[tools_end]["role"] == "tool":
            tools_end += 1
        if tools_end > position:
            dummy = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]
            prefix = render(dummy, False)
            full = render(dummy + messages[position:tools_end], True)
            cut = prefix.rfind(tokenizer.eos_token) + len(tokenizer.eos_token)
            delta = encode(full[cut:])
            ids, mask, position = ids + delta, mask + [0] * len(delta), tools_end
    return ids, mask


def sft(model, tokenizer, conversations: list[list[dict]], steps: int, batch_size: int, lr: float, seed: int,
        log_every: int = 100) -> float:
    """Plain next-token SFT on the masked tokens; returns the last logged loss."""
    import torch

    torch.manual_seed(seed)
    examples = [conversation_tokens(tokenizer, messages) for messages in conversations]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 50)
                                                 * max(0.05, 1 - step / steps))
    rng = random.Random(seed)
    model.train()
    loss_value = float("nan")
    for step in range(steps):
        batch = rng.sample(examples, min(batch_size, len(examples)))
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (ids, mask) in enumerate(batch):
            input_ids[row, :len(ids)] = torch.tensor(ids)
            attention[row, :len(ids)] = 1
            labels[row, :len(ids)] = torch.tensor([token if keep else -100 for token, keep in zip(ids, mask)])
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % log_every == 0 or step == steps - 1:
            loss_value = loss.item()
            print(f"[hybridrl] tool task SFT step {step}: loss {loss_value:.4f}", flush=True)
    model.eval()
    return loss_value


def tool_task_paths(cache_dir: str) -> dict[str, str]:
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir))
    data_dir = os.path.join(cache_dir, "data", "arithmetic_tool")
    return {"data_dir": data_dir, "train_file": os.path.join(data_dir, "train.parquet"),
            "tool_config": os.path.join(data_dir, "tools.yaml"),
            "val_file": os.path.join(data_dir, "test.parquet"),
            "model_dir": os.path.join(cache_dir, "models", "arithmetic_tool_sft")}


def ensure_tool_task_assets(config) -> None:
    """Prepare the task when the PPO config reads its model or data (--config-name tool_default)."""
    paths = tool_task_paths(config.cache_dir)
    used = [config.actor_rollout_ref.model.path] + list(config.data.train_files) + list(config.data.val_files)
    if any(os.path.abspath(os.path.expanduser(path)) in (paths["model_dir"], paths["train_file"], paths["val_file"])
           for path in used):
        prepare_tool_task(config.cache_dir)


def prepare_tool_task(cache_dir: str, recipe: ToolTaskRecipe | None = None) -> dict[str, str]:
    """Build the data and the warm-started model unless they are there, complete, with this recipe (the
    embedded default's stage mechanics: defaults/assets.py:build_stage)."""
    recipe = recipe or ToolTaskRecipe()
    paths = tool_task_paths(cache_dir)
    marker = dataclasses.asdict(recipe)

    def build_data(out_dir: str) -> str:
        from hybridrl.data.rl_parquet import write_rl_parquet

        train, test = make_rows(recipe)
        write_rl_parquet(train, os.path.join(out_dir, "train.parquet"))
        write_rl_parquet(test, os.path.join(out_dir, "test.parquet"))
        shutil.copy(TOOL_CONFIG, os.path.join(out_dir, "tools.yaml"))
        return f"{len(train)} train, {len(test)} test rows"

    data_rebuilt = build_stage("tool task data", paths["data_dir"], marker, _data_problem, build_data,
                               upstream_rebuilt=False)
    build_stage("tool task warm start", paths["model_dir"], marker, model_dir_problem,
                lambda out_dir: _build_model(out_dir, recipe, make_rows(recipe)[0]), upstream_rebuilt=data_rebuilt)
    return paths


def _data_problem(data_dir: str) -> str | None:
    missing = [name for name in ("train.parquet", "test.parquet", "tools.yaml")
               if not os.path.isfile(os.path.join(data_dir, name))]
    return f"{', '.join(missing)} missing" if missing else None


def _build_model(out_dir: str, recipe: ToolTaskRecipe, train_rows: list[dict]) -> str:
    """Tokenizer trained on the warm-start text, tiny Qwen2, SFT on the tool_agent token layout."""
    from transformers import AutoModelForCausalLM

    from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer
    from hybridrl.defaults.tool_chat_template import TOOL_CHAT_TEMPLATE

    conversations = warm_start_conversations(train_rows, recipe.tool_fraction, recipe.copy_drills)
    texts = [message["content"] for messages in conversations for message in messages] + \
        ["<|im_start|>system\nTools: calculator<|im_end|>\n<|im_start|>user\n<tool_response>\n</tool_response>"
         "<|im_start|>assistant\n"] * 50
    tokenizer = build_tokenizer(texts, vocab_size=recipe.vocab_size)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    build_tiny_model(out_dir, tokenizer, hidden_size=recipe.hidden_size, num_layers=recipe.num_layers,
                     num_heads=recipe.num_heads, num_kv_heads=recipe.num_kv_heads,
                     intermediate_size=recipe.intermediate_size, seed=recipe.seed)
    model = AutoModelForCausalLM.from_pretrained(out_dir)
    sft(model, tokenizer, conversations, recipe.sft_steps, recipe.sft_batch_size, recipe.sft_lr, recipe.seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    return f"{recipe.sft_steps} SFT steps on {len(conversations)} conversations"


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache_dir", default=os.environ.get("HYBRIDRL_CACHE_DIR", "~/.cache/hybridrl"))
    args = parser.parse_args()
    print(json.dumps(prepare_tool_task(args.cache_dir), indent=2))


if __name__ == "__main__":
    main()

"""reasoning-gym tasks as RL data: the prompt format, the answer extraction and the library's verifier.

These three belong together: the instruction tells the model to answer inside
<answer>...</answer>, `extract_answer` reads exactly that, and the task's own
`score_answer` (reasoning-gym's verifier, never a re-implementation) grades it.
`make_train_test_rows` generates the rows (examples/data_preprocess/reasoning_gym.py is its CLI).

Answer format: the content of the LAST complete <answer>...</answer> pair, stripped.
There is no fallback to the raw text: a response without the tags gets the verifier's score
for "no answer" (0.0), and an answer the verifier cannot parse (it raises) scores 0.0.
A fallback would pay format-free outputs, and reasoning-gym's partial credit for
"oracle contained in the answer" would then reward number spam.

A row's `extra_info` carries what the verifier needs: the task name, the JSON of the
generator kwargs (some verifiers read their dataset's config) and the JSON of the whole
entry (question, answer, metadata).
"""
from __future__ import annotations

import functools
import json
from decimal import Decimal
from fractions import Fraction
from typing import Any, Optional

from hybridrl.utils.reward_score.registry import register_scorer

DATA_SOURCE_PREFIX = "reasoning_gym/"
INSTRUCTION = "Give only the final answer inside <answer> </answer> tags."


def extract_answer(solution_str: str) -> Optional[str]:
    """The stripped content of the last <answer>...</answer> pair, or None (reasoning-gym's own extractor)."""
    from reasoning_gym.utils import extract_answer as library_extract_answer

    return library_extract_answer(solution_str, tag_name="answer", strip=True)


@register_scorer(DATA_SOURCE_PREFIX + "*")
def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict]) -> float:
    """Score a response to a reasoning-gym entry with the task's own `score_answer`."""
    if not extra_info or "entry_json" not in extra_info or "dataset_kwargs_json" not in extra_info:
        raise ValueError(
            f"{data_source}: extra_info must hold 'entry_json' and 'dataset_kwargs_json' "
            f"(write the data with examples/data_preprocess/reasoning_gym.py); got keys {sorted(extra_info or {})}"
        )
    task = data_source[len(DATA_SOURCE_PREFIX):]
    entry = json.loads(extra_info["entry_json"])
    if str(entry["answer"]) != str(ground_truth):
        raise ValueError(f"{data_source}: ground_truth {ground_truth!r} differs from the entry's answer "
                         f"{entry['answer']!r}")
    dataset = _task_dataset(task, extra_info["dataset_kwargs_json"])
    try:
        return float(dataset.score_answer(extract_answer(solution_str), entry))
    except Exception:  # a few verifiers (e.g. prime_factorization) raise on malformed answers instead of scoring 0
        return 0.0


@functools.lru_cache(maxsize=64)
def _task_dataset(task: str, dataset_kwargs_json: str):
    """The generator the entry came from, rebuilt once per process (its config can matter to the verifier)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(task, **json.loads(dataset_kwargs_json))


def make_rows(task: str, size: int, seed: int, split: str, task_config: Optional[dict] = None) -> list[dict]:
    """`size` entries of `task` generated with `seed`, as rows in verl's parquet layout."""
    import reasoning_gym

    dataset_kwargs = {**(task_config or {}), "seed": seed, "size": size}
    dataset = reasoning_gym.create_dataset(task, **dataset_kwargs)
    dataset_kwargs_json = json.dumps(dataset_kwargs, sort_keys=True)
    rows = []
    for index in range(size):
        entry = dataset[index]
        rows.append({
            "data_source": DATA_SOURCE_PREFIX + task,
            "prompt": [{"role": "user", "content": f"{entry['question']}\n{INSTRUCTION}"}],
            "ability": "reasoning",
            "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
            "extra_info": {
                "split": split,
                "index": index,
                "task": task,
                "entry_json": json.dumps(entry, default=_json_fallback, sort_keys=True),
                "dataset_kwargs_json": dataset_kwargs_json,
            },
        })
    return rows


def make_train_test_rows(task: str, train_size: int, test_size: int, seed: int,
                         task_config: Optional[dict] = None) -> tuple[list[dict], list[dict]]:
    """Train rows from `seed`, held-out test rows from `seed + train_size`, every row checked gradeable.

    reasoning-gym seeds entry i with seed + i, so seed + train_size continues the train stream
    instead of repeating it. Test questions that still occur in train (small tasks repeat) are
    dropped, and the count is printed.
    """
    train_rows = make_rows(task, train_size, seed, "train", task_config)
    test_rows = make_rows(task, test_size, seed + train_size, "test", task_config)
    train_prompts = {row["prompt"][0]["content"] for row in train_rows}
    held_out_rows = [row for row in test_rows if row["prompt"][0]["content"] not in train_prompts]
    print(f"{task}: {len(train_rows)} train rows, {len(held_out_rows)} test rows "
          f"({len(test_rows) - len(held_out_rows)} test questions also in train dropped)")
    check_oracle_answers(train_rows + held_out_rows)
    return train_rows, held_out_rows


def check_oracle_answers(rows: list[dict]) -> None:
    """Fail loudly unless the verifier gives each entry's own answer, in the stated format, full marks."""
    for row in rows:
        answer = row["reward_model"]["ground_truth"]
        score = compute_score(row["data_source"], f"<answer>{answer}</answer>", answer, row["extra_info"])
        if score != 1.0:
            raise RuntimeError(
                f"{row['data_source']} {row['extra_info']['split']} row {row['extra_info']['index']}: the verifier "
                f"scores the entry's own answer {answer!r} as {score}, not 1.0. This task cannot be used here: its "
                "'answer' is not a canonical solution, or its metadata does not survive JSON")


def _json_fallback(value: Any) -> Any:
    """JSON for the few non-JSON types in entry metadata; anything else is an error, not a silent str().

    Fractions and Decimals become their exact text ("7/2"); `check_oracle_answers`
    (the entry's own answer must still score 1.0) proves no verifier needed the original type.
    """
    if isinstance(value, (Fraction, Decimal)):
        return str(value)
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    if hasattr(value, "item") and callable(value.item):  # numpy scalar
        return value.item()
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy array
        return value.tolist()
    raise TypeError(f"entry metadata holds a {type(value).__name__} ({value!r}), which has no JSON form")

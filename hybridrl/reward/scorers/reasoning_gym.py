"""reasoning-gym tasks as RL data: the prompt format, the answer extraction and the library's verifier.

These three belong together: the instruction tells the model how to give its answer,
`extract_answer` reads exactly that, and the task's own `score_answer` (reasoning-gym's
verifier, never a re-implementation) grades it.
`make_train_test_rows` generates the rows (examples/data_preprocess/reasoning_gym.py is its CLI).

Answer formats (a row records its own in extra_info["answer_format"]; rows written before that key
existed are "tags"):
- "tags" (the default): the content of the LAST complete <answer>...</answer> pair, stripped.
- "hash": the number after the last "#### ", GSM8K's convention, read as the gsm8k scorer reads it
  (thousands separators, "$" and a trailing period dropped). Small chat models trained on GSM8K-style
  data follow it more often than tags. Numeric answers only: other tasks fail the oracle check.
There is no fallback to the raw text: a response without the format gets the verifier's score
for "no answer" (0.0), and an answer the verifier cannot parse (it raises) scores 0.0.
A fallback would pay format-free outputs, and reasoning-gym's partial credit for
"oracle contained in the answer" would then reward number spam.

A row's `extra_info` carries what the verifier needs: the task name, the JSON of the
generator kwargs (some verifiers read their dataset's config), the JSON of the whole
entry (question, answer, metadata) and the answer format.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Any, Optional

from hybridrl.reward.scorers import gsm8k
from hybridrl.reward.scorers.registry import register_scorer

DATA_SOURCE_PREFIX = "reasoning_gym/"


@dataclass(frozen=True)
class AnswerFormat:
    marker: str               # an instruction for this format must mention it
    instruction: str          # the default instruction, appended to each question
    oracle_template: str      # the entry's own answer written in this format (the gradeability check)


ANSWER_FORMATS = {
    "tags": AnswerFormat("<answer>", "Give only the final answer inside <answer> </answer> tags.",
                         "<answer>{answer}</answer>"),
    "hash": AnswerFormat("####", 'Let\'s think step by step and output the final answer after "####".',
                         "#### {answer}"),
}
INSTRUCTION = ANSWER_FORMATS["tags"].instruction


def extract_answer(solution_str: str, answer_format: str = "tags") -> Optional[str]:
    """The model's answer in `answer_format` (see the module docstring), or None when it gave none."""
    if answer_format == "tags":
        from reasoning_gym.utils import extract_answer as library_extract_answer

        return library_extract_answer(solution_str, tag_name="answer", strip=True)
    if answer_format == "hash":
        return gsm8k.extract_solution(solution_str, method="strict")
    raise ValueError(f"answer_format: expected one of {sorted(ANSWER_FORMATS)}, got {answer_format!r}")


def row_answer_format(extra_info: dict) -> str:
    """The answer format a row's prompt asked for ("tags" for rows written before the key existed)."""
    return extra_info.get("answer_format", "tags")


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
        return float(dataset.score_answer(extract_answer(solution_str, row_answer_format(extra_info)), entry))
    except Exception:  # a few verifiers (e.g. prime_factorization) raise on malformed answers instead of scoring 0
        return 0.0


@functools.lru_cache(maxsize=64)
def _task_dataset(task: str, dataset_kwargs_json: str):
    """The generator the entry came from, rebuilt once per process (its config can matter to the verifier)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(task, **json.loads(dataset_kwargs_json))


def make_rows(task: str, size: int, seed: int, split: str, task_config: Optional[dict] = None,
              answer_format: str = "tags", instruction: Optional[str] = None) -> list[dict]:
    """`size` entries of `task` generated with `seed`, as rows in verl's parquet layout.

    The user turn is the question, a newline, then `instruction` (default: the answer format's own).
    It may be reworded for a model (a small one may follow one wording better) but must mention the
    format's marker (<answer> or ####), the only place `extract_answer` looks.
    """
    import reasoning_gym

    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format: expected one of {sorted(ANSWER_FORMATS)}, got {answer_format!r}")
    marker = ANSWER_FORMATS[answer_format].marker
    instruction = ANSWER_FORMATS[answer_format].instruction if instruction is None else instruction
    if marker not in instruction:
        raise ValueError(f"instruction {instruction!r} must ask for the answer with {marker}: with "
                         f"answer_format={answer_format!r} the scorer reads the answer only there")

    dataset_kwargs = {**(task_config or {}), "seed": seed, "size": size}
    dataset = reasoning_gym.create_dataset(task, **dataset_kwargs)
    dataset_kwargs_json = json.dumps(dataset_kwargs, sort_keys=True)
    rows = []
    for index in range(size):
        entry = dataset[index]
        rows.append({
            "data_source": DATA_SOURCE_PREFIX + task,
            "prompt": [{"role": "user", "content": f"{entry['question']}\n{instruction}"}],
            "ability": "reasoning",
            "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
            "extra_info": {
                "split": split,
                "index": index,
                "task": task,
                "entry_json": json.dumps(entry, default=_json_fallback, sort_keys=True),
                "dataset_kwargs_json": dataset_kwargs_json,
                "answer_format": answer_format,
            },
        })
    return rows


def make_train_test_rows(task: str, train_size: int, test_size: int, seed: int, task_config: Optional[dict] = None,
                         answer_format: str = "tags", instruction: Optional[str] = None,
                         drop_ungradeable: bool = False) -> tuple[list[dict], list[dict]]:
    """Train rows from `seed`, held-out test rows from `seed + train_size`, every row checked gradeable.

    reasoning-gym seeds entry i with seed + i, so seed + train_size continues the train stream
    instead of repeating it. Test questions that still occur in train (small tasks repeat) are
    dropped, and the count is printed.

    Gradeable: the verifier gives the entry's own answer, written in the answer format, full marks. A task
    with an ungradeable row is refused, unless `drop_ungradeable`: then those rows are left out and
    counted (gsm_symbolic needs it: about 1 entry in 1500 has the answer -1, which its verifier reads
    as 1; the question is a broken template instance). Nothing is written if no row is left.
    """
    train_rows = make_rows(task, train_size, seed, "train", task_config, answer_format, instruction)
    test_rows = make_rows(task, test_size, seed + train_size, "test", task_config, answer_format, instruction)
    train_prompts = {row["prompt"][0]["content"] for row in train_rows}
    held_out_rows = [row for row in test_rows if row["prompt"][0]["content"] not in train_prompts]
    ungradeable = ungradeable_rows(train_rows + held_out_rows)
    if ungradeable and not drop_ungradeable:
        row, score = ungradeable[0]
        raise RuntimeError(
            f"{_row_name(row)}: the verifier scores the entry's own answer {row['reward_model']['ground_truth']!r} "
            f"as {score}, not 1.0 ({len(ungradeable)} such rows). This task cannot be used here as it is: its "
            "'answer' is not a canonical solution, or its metadata does not survive JSON; if only a few rows are "
            "affected, leave them out with drop_ungradeable (--drop_ungradeable)")
    dropped = {id(row) for row, _ in ungradeable}
    kept_train = [row for row in train_rows if id(row) not in dropped]
    kept_test = [row for row in held_out_rows if id(row) not in dropped]
    notes = [f"{len(test_rows) - len(held_out_rows)} test questions also in train dropped"]
    if ungradeable:
        notes.append(f"{len(ungradeable)} ungradeable rows dropped: " + ", ".join(
            f"{_row_name(row)} (answer {row['reward_model']['ground_truth']!r} scores {score})"
            for row, score in ungradeable))
    print(f"{task}: {len(kept_train)} train rows, {len(kept_test)} test rows ({'; '.join(notes)})")
    if not kept_train or not kept_test:
        raise RuntimeError(f"{task}: no {'train' if not kept_train else 'test'} row is left after dropping "
                           f"{len(ungradeable)} ungradeable rows")
    return kept_train, kept_test


def ungradeable_rows(rows: list[dict]) -> list[tuple[dict, float]]:
    """The rows whose own answer, in the row's answer format, the verifier does not give full marks, with that score."""
    ungradeable = []
    for row in rows:
        answer = row["reward_model"]["ground_truth"]
        oracle = ANSWER_FORMATS[row_answer_format(row["extra_info"])].oracle_template.format(answer=answer)
        score = compute_score(row["data_source"], oracle, answer, row["extra_info"])
        if score != 1.0:
            ungradeable.append((row, score))
    return ungradeable


def _row_name(row: dict) -> str:
    return f"{row['data_source']} {row['extra_info']['split']} row {row['extra_info']['index']}"


def _json_fallback(value: Any) -> Any:
    """JSON for the few non-JSON types in entry metadata; anything else is an error, not a silent str().

    Fractions and Decimals become their exact text ("7/2"); `ungradeable_rows`
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

"""Write train/test parquet for one reasoning-gym task, in the same layout as the GSM8K data.

    python examples/data_preprocess/reasoning_gym.py --task chain_sum --size 2000 --test_size 200 \
        --seed 0 --local_dir ~/data/chain_sum [--task_config '{"max_terms": 2, "max_digits": 1}'] \
        [--answer_format tags|hash] [--instruction TEXT] [--drop_ungradeable] [--held_out_templates SHARE]
        [--in_template_test_size N]

The train split is entries 0..size-1 of --seed; the test split is generated with seed --seed + --size
(it continues the train stream), minus questions that also occur in train.

The user turn is the question, a newline and --instruction, which asks for the answer in
--answer_format: "tags" (default: "Give only the final answer inside <answer> </answer> tags.") or
"hash" (GSM8K's "#### N", for numeric tasks). Reword the instruction for a model that follows
another wording better; it must still name the format's marker (<answer> or ####).

Every row is checked before writing: its own answer, written in the answer format, must score 1.0
with the task's verifier. A task with a row that fails is refused, unless --drop_ungradeable: then
those rows are left out and counted (gsm_symbolic needs it for a rare broken template instance).
The same is `make_train_test_rows` in hybridrl.reward.scorers.reasoning_gym.

--held_out_templates SHARE (gsm_symbolic only) splits by template instead, so the test measures transfer to
problems never trained on, not the same problem with other names and numbers: gsm_symbolic draws each question
from one of its templates (`dataset.task_indices[index]`), and SHARE of them, chosen with --seed, appear only in
test.parquet. train.parquet holds the first --size questions of the other templates from --seed,
test_in_template.parquet the first --in_template_test_size (default --test_size) questions that follow of the
templates in train.parquet (without those also in train), test.parquet the first --test_size questions of the held-out
templates from the same stream. Either file's first N rows are the same for any larger size, so a larger test set
extends a smaller one.
Each row's extra_info names its template (`template`), and the script prints how many questions each template has
in each file.
"""
import argparse
import json
import os
import sys
from collections import Counter
from random import Random

# This file is named like the library it uses: drop its own folder from the import path, or
# `import reasoning_gym` would import this script.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

from hybridrl.data.rl_parquet import write_rl_parquet  # noqa: E402
from hybridrl.reward.scorers.reasoning_gym import (  # noqa: E402
    ANSWER_FORMATS, make_rows, make_train_test_rows, ungradeable_rows)

TEMPLATE_TASK = "gsm_symbolic"  # the one reasoning-gym task that picks each question's template (task_indices)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True, help="a reasoning-gym dataset name, e.g. chain_sum")
    parser.add_argument("--size", type=int, required=True, help="train rows")
    parser.add_argument("--test_size", type=int, required=True,
                        help="test rows (before dropping overlaps; with --held_out_templates: in each test file)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task_config", default="{}", help="JSON of the task's config fields (difficulty)")
    parser.add_argument("--answer_format", choices=sorted(ANSWER_FORMATS), default="tags",
                        help="how the answer is given and read: <answer>N</answer> (tags) or #### N (hash)")
    parser.add_argument("--instruction", default=None,
                        help="appended to each question on its own line (default: the answer format's own); "
                             "must name the format's marker, <answer> or ####")
    parser.add_argument("--drop_ungradeable", action="store_true",
                        help="leave out (and count) rows whose own answer the verifier does not give 1.0, "
                             "instead of refusing the task; gsm_symbolic needs it")
    parser.add_argument("--held_out_templates", type=float, default=None, metavar="SHARE",
                        help=f"({TEMPLATE_TASK} only) this share of the templates, chosen with --seed, only in "
                             "test.parquet; the training templates' test questions in test_in_template.parquet")
    parser.add_argument("--in_template_test_size", type=int, default=None,
                        help="with --held_out_templates: rows of test_in_template.parquet (default --test_size)")
    parser.add_argument("--local_dir", required=True)
    args = parser.parse_args()
    task_config = json.loads(args.task_config)
    local_dir = os.path.expanduser(args.local_dir)

    if args.held_out_templates is None:
        if args.in_template_test_size is not None:
            parser.error("--in_template_test_size: only with --held_out_templates (it sizes test_in_template.parquet)")
        files = dict(zip(("train", "test"), make_train_test_rows(
            args.task, args.size, args.test_size, args.seed, task_config, args.answer_format, args.instruction,
            args.drop_ungradeable)))
    else:
        if args.task != TEMPLATE_TASK:
            parser.error(f"--held_out_templates: only {TEMPLATE_TASK} draws its questions from templates, "
                         f"got --task {args.task}")
        in_template = args.test_size if args.in_template_test_size is None else args.in_template_test_size
        sizes = {"train": args.size, "test": args.test_size, "test_in_template": in_template}
        files = template_split_rows(args.held_out_templates, sizes, args.seed, task_config, args.answer_format,
                                    args.instruction, args.drop_ungradeable)
    for name, rows in files.items():
        write_rl_parquet(rows, os.path.join(local_dir, f"{name}.parquet"))
    print("wrote " + " and ".join(os.path.join(local_dir, f"{name}.parquet") for name in files))


def split_templates(share: float, seed: int) -> tuple[set[int], set[int]]:
    """(training templates, held-out templates): round(share x all of them) held out, a sample drawn with `seed`, so
    the split is reproducible."""
    from reasoning_gym.arithmetic.gsm_symbolic.gsm_symbolic import tasks_ok  # the templates its dataset draws from

    templates = sorted(tasks_ok)
    count = round(share * len(templates))
    if not 0 < count < len(templates):
        raise ValueError(f"--held_out_templates {share}: expected a share that holds out at least one of the "
                         f"{len(templates)} templates and keeps at least one for training")
    held_out = set(Random(seed).sample(templates, count))
    return set(templates) - held_out, held_out


def template_split_rows(share: float, sizes: dict[str, int], seed: int, task_config: dict, answer_format: str,
                        instruction, drop_ungradeable: bool) -> dict[str, list[dict]]:
    """train, test (held-out templates) and test_in_template rows, as many as `sizes` says for each (the module
    docstring); prints the counts."""
    trained, held_out = split_templates(share, seed)
    options = (task_config, answer_format, instruction, drop_ungradeable)
    train, drawn, train_notes = first_rows_by_template(seed, {"train": trained}, sizes, set(), *options)
    train_prompts = {row["prompt"][0]["content"] for row in train["train"]}
    seen = {row["extra_info"]["template"] for row in train["train"]}  # all of `trained` unless --size is small
    # the test stream continues the train stream (reasoning-gym seeds entry i with seed + i)
    tests, _, test_notes = first_rows_by_template(seed + drawn, {"test": held_out, "test_in_template": seen},
                                                  sizes, train_prompts, *options)
    files = {**train, **tests}
    print(f"{TEMPLATE_TASK} by template: {len(held_out)} of {len(trained) + len(held_out)} templates held out of "
          f"training (--held_out_templates {share}, seed {seed}): {', '.join(map(str, sorted(held_out)))}")
    for name, rows in files.items():
        per_template = Counter(row["extra_info"]["template"] for row in rows)
        notes = "".join(f", {note}" for note in {**train_notes, **test_notes}[name])
        print(f"  {name}: {len(rows)} rows of {len(per_template)} templates{notes}; questions per template: "
              + " ".join(f"{template}:{n}" for template, n in sorted(per_template.items())))
    return files


def first_rows_by_template(seed: int, templates_of: dict[str, set[int]], sizes: dict[str, int], skip_prompts: set[str],
                           task_config: dict, answer_format: str, instruction, drop_ungradeable: bool):
    """For each split in `templates_of`, the first `sizes[split]` gradeable rows of the stream of `seed` whose template
    is one of its templates and whose prompt is not in `skip_prompts`; how many entries of the stream that took; and
    per split, what was left out and why.

    reasoning-gym seeds entry i with seed + i and picks its template with a Random(seed) drawn in order, so a longer
    stream starts with the same entries: the stream is generated again, twice as long, until every split is full.
    """
    import reasoning_gym

    length = 2 * sum(sizes[name] for name in templates_of)
    while True:
        task_indices = reasoning_gym.create_dataset(TEMPLATE_TASK, seed=seed, size=length, **task_config).task_indices
        rows = make_rows(TEMPLATE_TASK, length, seed, "", task_config, answer_format, instruction)
        picked = {name: [] for name in templates_of}
        skipped = {name: Counter() for name in templates_of}
        for index, row in enumerate(rows):
            name = next((name for name, templates in templates_of.items() if task_indices[index] in templates), None)
            if name is None or len(picked[name]) == sizes[name]:
                continue
            if row["prompt"][0]["content"] in skip_prompts:
                skipped[name]["questions also in train skipped"] += 1
                continue
            if ungradeable_rows([row]):
                if not drop_ungradeable:
                    raise RuntimeError(f"reasoning_gym/{TEMPLATE_TASK} row {index} of seed {seed}: the verifier does "
                                       "not give the entry's own answer full marks; leave such rows out with "
                                       "--drop_ungradeable")
                skipped[name]["ungradeable rows skipped"] += 1
                continue
            row["extra_info"].update(split=name, template=task_indices[index])
            picked[name].append(row)
            if all(len(rows_of) == sizes[name] for name, rows_of in picked.items()):
                notes = {name: [f"{n} {why}" for why, n in reasons.items()] for name, reasons in skipped.items()}
                return picked, index + 1, notes
        length *= 2


if __name__ == "__main__":
    main()

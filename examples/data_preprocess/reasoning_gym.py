"""Write train/test parquet for one reasoning-gym task, in the same layout as the GSM8K data.

    python examples/data_preprocess/reasoning_gym.py --task chain_sum --size 2000 --test_size 200 \
        --seed 0 --local_dir ~/data/chain_sum [--task_config '{"max_terms": 2, "max_digits": 1}'] \
        [--answer_format tags|hash] [--instruction TEXT] [--drop_ungradeable]

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
"""
import argparse
import json
import os
import sys

# This file is named like the library it uses: drop its own folder from the import path, or
# `import reasoning_gym` would import this script.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

from hybridrl.data.rl_parquet import write_rl_parquet  # noqa: E402
from hybridrl.reward.scorers.reasoning_gym import ANSWER_FORMATS, make_train_test_rows  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True, help="a reasoning-gym dataset name, e.g. chain_sum")
    parser.add_argument("--size", type=int, required=True, help="train rows")
    parser.add_argument("--test_size", type=int, required=True, help="test rows (before dropping overlaps)")
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
    parser.add_argument("--local_dir", required=True)
    args = parser.parse_args()

    train_rows, test_rows = make_train_test_rows(args.task, args.size, args.test_size, args.seed,
                                                 json.loads(args.task_config), args.answer_format,
                                                 args.instruction, args.drop_ungradeable)
    local_dir = os.path.expanduser(args.local_dir)
    write_rl_parquet(train_rows, os.path.join(local_dir, "train.parquet"))
    write_rl_parquet(test_rows, os.path.join(local_dir, "test.parquet"))
    print(f"wrote {os.path.join(local_dir, 'train.parquet')} and {os.path.join(local_dir, 'test.parquet')}")


if __name__ == "__main__":
    main()

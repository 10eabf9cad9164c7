"""Write train/test parquet for one reasoning-gym task, in the same layout as the GSM8K data.

    python examples/data_preprocess/reasoning_gym.py --task chain_sum --size 2000 --test_size 200 \
        --seed 0 --local_dir ~/data/chain_sum [--task_config '{"max_terms": 2, "max_digits": 1}']

The train split is entries 0..size-1 of --seed; the test split is generated with seed --seed + --size
(it continues the train stream), minus questions that also occur in train. Every row is checked
before writing: its own answer, in the stated <answer></answer> format, must score 1.0 with the
task's verifier. The same is `make_train_test_rows` in hybridrl.utils.reward_score.reasoning_gym.
"""
import argparse
import json
import os
import sys

# This file is named like the library it uses: drop its own folder from the import path, or
# `import reasoning_gym` would import this script.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

from hybridrl.utils.rl_parquet import write_rl_parquet  # noqa: E402
from hybridrl.utils.reward_score.reasoning_gym import make_train_test_rows  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True, help="a reasoning-gym dataset name, e.g. chain_sum")
    parser.add_argument("--size", type=int, required=True, help="train rows")
    parser.add_argument("--test_size", type=int, required=True, help="test rows (before dropping overlaps)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task_config", default="{}", help="JSON of the task's config fields (difficulty)")
    parser.add_argument("--local_dir", required=True)
    args = parser.parse_args()

    train_rows, test_rows = make_train_test_rows(args.task, args.size, args.test_size, args.seed,
                                                 json.loads(args.task_config))
    local_dir = os.path.expanduser(args.local_dir)
    write_rl_parquet(train_rows, os.path.join(local_dir, "train.parquet"))
    write_rl_parquet(test_rows, os.path.join(local_dir, "test.parquet"))
    print(f"wrote {os.path.join(local_dir, 'train.parquet')} and {os.path.join(local_dir, 'test.parquet')}")


if __name__ == "__main__":
    main()

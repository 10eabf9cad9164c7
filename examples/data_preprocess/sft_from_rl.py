"""Turn reasoning-gym RL parquet (examples/data_preprocess/reasoning_gym.py) into chat SFT parquet for main_sft.

    python examples/data_preprocess/sft_from_rl.py --rl_parquet ~/data/chain_sum/train.parquet \
        --out ~/data/chain_sum/sft_train.parquet [--tagged_fraction 1.0]

Each row becomes {"messages": prompt + [assistant answer]}. The answer is the ground truth in the
graded format, `<answer>N</answer>`, for --tagged_fraction of the rows (spread evenly), and
`The answer is N.` for the rest; the embedded default uses 0.2 to leave GRPO a format to learn
(see hybridrl/defaults/assets.py). Then:

    python -m hybridrl.trainer.main_sft data.train_files=~/data/chain_sum/sft_train.parquet \
        data.val_files=null model.partial_pretrain=/path/to/model trainer.default_local_dir=/tmp/sft
"""
import argparse
import os

import pyarrow.parquet as pq

from hybridrl.defaults.assets import sft_rows_from_rl, write_sft_parquet
from hybridrl.reward.scorers.reasoning_gym import DATA_SOURCE_PREFIX


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rl_parquet", required=True, help="RL rows in verl's layout from a reasoning-gym task")
    parser.add_argument("--out", required=True, help="the SFT parquet to write (a `messages` column)")
    parser.add_argument("--tagged_fraction", type=float, default=1.0,
                        help="share of answers in the graded <answer></answer> format (default: all)")
    args = parser.parse_args()

    rl_rows = pq.read_table(os.path.expanduser(args.rl_parquet)).to_pylist()
    for position, row in enumerate(rl_rows):
        if not str(row.get("data_source", "")).startswith(DATA_SOURCE_PREFIX):
            raise SystemExit(f"{args.rl_parquet} row {position}: data_source {row.get('data_source')!r} is not a "
                             f"reasoning-gym task ({DATA_SOURCE_PREFIX}*); its answer format is not <answer></answer>")
    rows = sft_rows_from_rl(rl_rows, args.tagged_fraction)
    write_sft_parquet(rows, os.path.expanduser(args.out))
    print(f"wrote {len(rows)} conversations to {args.out}")


if __name__ == "__main__":
    main()

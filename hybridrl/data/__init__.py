"""Data: RL and SFT datasets from parquet (rl_dataset, sft_dataset, rl_parquet), length-balanced splits
(seqlen_balancing), and the data flow: Sample records, the prompt source with its buffer, filters and hooks (README:
"Sample buffer, dynamic sampling, partial rollout")."""

"""Pure PPO-family math: advantage estimators, policy/value losses, KL, loss aggregation (no I/O, no workers)."""

"""The embedded default that `python -m hybridrl.main_ppo` runs with no overrides: built-in task, tiny model, warm start."""

"""hybridrl: a single-controller, hybrid-engine PPO/GRPO trainer for LLMs."""
from hybridrl.utils.logging import configure_logging

configure_logging()

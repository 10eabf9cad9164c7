"""The user's scoring function, `custom_reward_function.path/name`: used alone by the reward managers and as the
reward hub's scorer that wins over every named one. Its own module, so that the hub and the manager loader, which
each use the other's half, both import it instead of each other."""
from __future__ import annotations

from hybridrl.utils.import_utils import load_extern_object


def load_user_reward_fn(config):
    """The user's function `custom_reward_function.path/name`, or None when the path is unset."""
    custom = config.get("custom_reward_function") or {}
    if not custom.get("path"):
        return None
    return load_extern_object(custom["path"], custom["name"])

"""Registers every subsystem's config checks with hybridrl.config.checks; import it before validating a config.

Config imports no subsystem, so the rules that need a subsystem's registries and helpers live beside that
subsystem's code, in its `config_checks.py`, and register themselves when imported: this module is the one place
that imports them all. The entry points (main_ppo) and anything else that calls validate_config or
check_before_start import it; the drivers refuse to run before it has been imported. Checks run, and their problems
are listed, in the order of the imports below.
Importing it imports torch (the rollout and agent-loop packages do): main_ppo imports it only once a run starts.
"""
from hybridrl.config.checks import all_registered
import hybridrl.algorithms.config_checks  # noqa: F401
import hybridrl.data.config_checks  # noqa: F401
import hybridrl.models.config_checks  # noqa: F401
import hybridrl.workers.config_checks  # noqa: F401
import hybridrl.workers.rollout.config_checks  # noqa: F401
import hybridrl.reward.config_checks  # noqa: F401
import hybridrl.tools.config_checks  # noqa: F401
import hybridrl.interactions.config_checks  # noqa: F401
import hybridrl.agent_loop.config_checks  # noqa: F401
import hybridrl.single_controller.config_checks  # noqa: F401
import hybridrl.trainer.config_checks  # noqa: F401

all_registered()

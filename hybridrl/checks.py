"""Registers every subsystem's config checks with hybridrl.config.checks; import it before validating a config.

Config imports no subsystem, so the rules that need a subsystem's registries and helpers live beside that
subsystem's code, in its `config_checks.py`, and register themselves when imported: this module is the one place
that imports them all. The entry points (main_ppo) and anything else that calls validate_config or
check_before_start import it; the drivers refuse to run before it has been imported. Checks run, and their problems
are listed, in the order of the imports below.
Importing it imports torch (the rollout and agent-loop packages do): main_ppo imports it only once a run starts.
"""
from hybridrl.config.checks import all_registered
from hybridrl.algorithms import config_checks as _algorithms  # noqa: F401
from hybridrl.data import config_checks as _data  # noqa: F401
from hybridrl.models import config_checks as _models  # noqa: F401
from hybridrl.workers import config_checks as _workers  # noqa: F401
from hybridrl.workers.rollout import config_checks as _rollout  # noqa: F401
from hybridrl.reward import config_checks as _reward  # noqa: F401
from hybridrl.tools import config_checks as _tools  # noqa: F401
from hybridrl.interactions import config_checks as _interactions  # noqa: F401
from hybridrl.agent_loop import config_checks as _agent_loop  # noqa: F401
from hybridrl.single_controller import config_checks as _single_controller  # noqa: F401
from hybridrl.trainer import config_checks as _trainer  # noqa: F401

all_registered()

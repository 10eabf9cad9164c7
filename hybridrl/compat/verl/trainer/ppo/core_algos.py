"""verl's `verl.trainer.ppo.core_algos`: this path is `hybridrl.algorithms.core_algos` itself, not a copy of its names.

verl's code (its tests included) rebinds module globals such as `core_algos.ADV_ESTIMATOR_REGISTRY` and
expects `register_adv_est` to see the new dict; a re-export would leave our functions reading the old one.
So the import system hands out our module object under this name too.
"""
import sys

from hybridrl.algorithms import core_algos

sys.modules[__name__] = core_algos

"""How work is dispatched: a Worker per rank, @register to say how a call spreads over the ranks,
and Ray resource pools and worker groups (hybridrl.single_controller.ray) to run them."""
from hybridrl.single_controller.decorator import Dispatch, Execute, register
from hybridrl.single_controller.worker import Worker

__all__ = ["Dispatch", "Execute", "Worker", "register"]

from hybridrl.utils.rollout_trace import rollout_trace_op

__all__ = ["rollout_trace_op"]

"""`rollout_trace_op`, so verl tools that decorate `execute` with it port by changing imports only.

verl records traced calls to an experiment tracker; hybridrl has no rollout tracing yet, so the
decorator returns the function unchanged.
"""


def rollout_trace_op(function):
    return function

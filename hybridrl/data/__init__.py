"""Samples, the prompt source with its buffer, and the data-flow hooks (README: "Sample buffer, dynamic sampling,
partial rollout")."""

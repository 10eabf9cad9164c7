"""Model state on a device: load and shard with FSDP (fsdp_utils), park in CPU memory (offload), packed rows
(padding, attention), log-probs without full logits (fused_logprob), sharded checkpoints (checkpoint), FLOPs and
memory metrics."""

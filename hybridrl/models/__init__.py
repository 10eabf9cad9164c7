"""Model state on a device: attention kernels for packed rows, FLOP counts."""

"""Kernels that move data between GPUs: the host mailbox."""

"""Per-token ops of a decoder layer: RMSNorm, rotary embedding (fused with the cache write),
SiLU-and-multiply."""

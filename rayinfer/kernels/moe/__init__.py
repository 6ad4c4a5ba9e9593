"""Mixture of experts: router logits, routing, alignment by expert, the fused expert GEMMs, the
expert exchange's row passes and combine."""

"""Multi-head latent attention over the paged latent cache: prefill, absorbed decode, the cache
write."""

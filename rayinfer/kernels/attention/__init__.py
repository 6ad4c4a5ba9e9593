"""GQA attention over the paged K/V cache: mixed and prefill (flash) attention, the cache
write."""

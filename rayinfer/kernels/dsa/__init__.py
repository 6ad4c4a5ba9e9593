"""Sparse attention over the paged cache: DeepSeek's lightning indexer (and its FP8 keys), sparse
MLA, DeepSeek-V4's sliding-window and compressed attention."""

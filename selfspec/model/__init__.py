"""Model plumbing: running an unmodified transformers causal LM over draft trees (targets,
attention masks, KV caches, layer slices, taps, the LM head) and loading targets."""

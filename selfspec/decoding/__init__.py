"""The decoding core: the decode step, requests, draft trees, the pure verifier, sampling, logits
processing and constraints. Nothing here loads a model or knows a drafter's internals."""

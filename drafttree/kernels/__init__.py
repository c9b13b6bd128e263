"""Hand-written kernels (Triton) and the lazy loader they compile through."""

"""Hand-written kernels (Triton), their torch fallbacks (`torch_ops`), and `dispatch`, which model
and spec code call and which chooses between the two."""

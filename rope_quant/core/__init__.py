"""Pure math: RoPE geometry, angles, paired statistics, Hadamard matrices, the R3 registry."""

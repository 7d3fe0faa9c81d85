"""mlaq's C kernels (``csrc/``), compiled on first use: absorbed-MLA decode and the bf16 BMMs."""

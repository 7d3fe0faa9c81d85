"""The model's layers: MLA attention (its latent cache, flash and absorbed paths), RoPE, norms, linears,
MoE, DSA's indexer, MTP, the decoder layer, the whole causal LM and its step-by-step pieces."""

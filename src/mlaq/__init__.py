"""mlaq — quantize Multi-head Latent Attention safely.

Layers, top-down (a lower layer never imports a higher one):
``formats`` (bits) → ``bmm`` (absorbed-matmul schemes) → ``policy`` (who gets which scheme, and why)
→ ``model`` (MLA, MoE, MTP, loading) → ``engine`` → ``validate`` / ``cli``.
"""

__version__ = "0.1.0"

"""mlaq — quantize Multi-head Latent Attention safely.

Layers, top-down (a lower layer never imports a higher one):
``formats`` (bits) → ``bmm`` (absorbed-matmul schemes) → ``policy`` (who gets which scheme, and why)
→ ``model`` (MLA, MoE, MTP, loading) → ``engine`` → ``validate`` / ``cli``.
"""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> object:
    """``mlaq.LLM`` and ``mlaq.SamplingParams``, imported on first use (``import mlaq`` stays light)."""
    if name == "LLM":
        from mlaq.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from mlaq.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'mlaq' has no attribute {name!r}")

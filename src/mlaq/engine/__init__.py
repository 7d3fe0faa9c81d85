"""The generation engine: sampling, speculative decoding, the paged latent KV cache, scheduling.

Public pieces (the model-driving ``LLM`` arrives with the model): ``SamplingParams``,
``sampler.sample``, ``rejection.rejection_sample``, ``SpecDecodingStats``, ``BlockManager``,
``LatentKVCache``, ``Tokenizer``, ``IncrementalDetokenizer``, ``Scheduler``.
"""

from mlaq.engine.sampling_params import SamplingParams
from mlaq.engine.spec_metrics import SpecDecodingStats

__all__ = ["SamplingParams", "SpecDecodingStats"]

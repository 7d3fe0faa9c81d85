"""The generation engine: sampling, MTP speculative decoding, the paged latent KV cache, scheduling.

``LLM`` (vLLM's offline API) drives an ``LLMEngine``: ``Scheduler`` + ``BlockManager`` decide who runs
and where tokens live, ``LatentKVCache`` stores [c_kv | k_pe], ``ModelRunner`` feeds the model
(``model_api.LatentLM``; ``adapter`` wraps mlaq's DeepSeek models), ``sampler`` and
``rejection.rejection_sample`` choose tokens, ``SpecDecodingStats`` counts acceptance as vLLM does.
"""

from mlaq.engine.llm import LLM
from mlaq.engine.outputs import CompletionOutput, RequestOutput
from mlaq.engine.sampling_params import SamplingParams
from mlaq.engine.spec_metrics import SpecDecodingStats

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "SpecDecodingStats"]

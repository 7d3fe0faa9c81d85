"""Talking to live OpenAI-compatible servers (vLLM, SGLang, mlaq serve) for ``mlaq validate --server``:
the HTTP client, the wire formats, the target, the recorded reference. Needs httpx (the ``remote``
extra). The measurement source built on it is ``mlaq.validate.sources.server``."""

from mlaq.validate.server.client import ClientConfig, ServerError, Unsupported
from mlaq.validate.server.config import ServerValidateConfig

__all__ = ["ClientConfig", "ServerError", "ServerValidateConfig", "Unsupported"]

"""``mlaq validate --server URL``: measure a live OpenAI-compatible deployment (vLLM, SGLang, mlaq serve)
against a reference server or a recorded reference. Needs httpx (the ``remote`` extra)."""

from mlaq.validate.server.client import ClientConfig, ServerError, Unsupported
from mlaq.validate.server.config import ServerValidateConfig
from mlaq.validate.server.runner import run_server_validation

__all__ = ["ClientConfig", "ServerError", "ServerValidateConfig", "Unsupported", "run_server_validation"]

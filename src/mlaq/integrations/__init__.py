"""mlaq inside other serving frameworks. ``mlaq.integrations.vllm``: the vLLM general plugin.

Layering: above validate / serve / audit, below cli. Importing this package imports nothing of the
framework it integrates with; that happens when the framework calls the plugin's entry point.
"""

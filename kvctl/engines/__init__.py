"""Inference-engine integrations: the reference transformers adapter and the vLLM connector.

These modules need torch (``pip install 'kvctl[engine]'``); nothing in the agent, the store or
the CLI's start-up imports them.
"""

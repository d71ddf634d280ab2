"""Tiers beyond one node: the shared remote pool (Redis/Valkey, or a pool agent), peer agents in
other nodes and DCs, the links between them, and the fetch-or-recompute decision.

Layering: ``kvctl.remote`` builds on ``kvctl.store`` and the SDK (``kvctl.client``); the store
never imports it, and nothing here imports a UI library.
"""

"""The errors kvctl raises for a user to act on: bad input, or a state they can fix. The CLI,
the control API and the live view turn any of them into a clear message instead of a trace."""

from __future__ import annotations


class KvctlError(Exception):
    """Base class of every error kvctl raises on purpose."""


class InvalidArgument(KvctlError, ValueError):
    """A value kvctl cannot accept (bad size, bad key, bad option); nothing was changed."""

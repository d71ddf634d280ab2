"""What an agent says while it opens its tiers, known to every layer that reports a node's
state: the agent answers with it, the SDK raises AgentStarting on it, and the collectors'
records keep it as the sample's error, where the read model finds it again (``kvctl.db`` sits
below the SDK, so the words live here, beneath both)."""

from __future__ import annotations

#: the 503 answer's detail, as the control API words its own errors ({"detail": ...})
STARTING_DETAIL = (
    "the agent is starting: it is opening its tiers (a large disk tier's scan can take "
    "minutes) and serves its API once they are open; try again shortly"
)
#: how every report of a starting agent begins (the SDK's error adds the agent's URL)
STARTING_PREFIX = "the agent is starting:"


def says_starting(error: str | None) -> bool:
    """Whether ``error`` (a recorded sample's, an SDK error's text) is an agent's "starting"
    answer: up, still opening its tiers, and not down."""
    return error is not None and error.startswith(STARTING_PREFIX)

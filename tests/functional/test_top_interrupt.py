"""`kvctl top --json` and Ctrl-C: as the other read-only commands (status, lookup, doctor), one
line "interrupted" on stderr and exit 130; before, it exited 130 in silence. Against a
loopback stand-in for a hung agent, with a --timeout far beyond the hang guard."""

from __future__ import annotations

from tests.functional.hung import SIGINT_ONCE_ASLEEP, ctrl_c, hung_http_agent
from tests.functional.test_cli_failures_readonly import LONG_TIMEOUT_S


def test_ctrl_c_during_top_json_says_interrupted() -> None:
    """As the other read-only commands: one line, exit 130, where it exited in silence."""
    with hung_http_agent() as hung:
        argv = ["-m", "kvctl", "top", "--json", "--agent", hung.url]
        code, said, out = ctrl_c([*argv, "--timeout", str(LONG_TIMEOUT_S)], hung.asked)
    assert code == 130, said
    assert said == "interrupted" and out == b"", said


def test_ctrl_c_while_the_poll_sleeps_ends_top_json_at_once() -> None:
    """The SIGINT taken once the main thread sleeps in the poll's wait for the hung agent: it
    slept on to the end of the wait (--timeout, here far beyond the hang guard), stderr empty,
    as a CI run on a loaded machine saw; each sleep is now short, and its end raises it."""
    with hung_http_agent() as hung:
        argv = ["top", "--json", "--agent", hung.url, "--timeout", str(LONG_TIMEOUT_S)]
        code, said, out = ctrl_c(["-c", SIGINT_ONCE_ASLEEP, "answers", *argv], None)
    assert code == 130, said
    assert said == "interrupted" and out == b"", said

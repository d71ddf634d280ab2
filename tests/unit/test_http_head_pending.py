"""``http_serving.HeadPending``: which connection waiting for a request's head is closed to
make room, per source and in all. Each connection here is one end of a real socket pair, the
client's end being the other."""

from __future__ import annotations

import select
import socket
from collections.abc import Iterator

import pytest

from kvctl.http_serving import HeadPending, source_key


class _Conn:
    def __init__(self) -> None:
        self.server, self.client = socket.socketpair()
        self.closed_to_make_room = False

    def has_unread_bytes(self) -> bool:
        return bool(select.select([self.server], [], [], 0)[0])

    def close_to_make_room(self) -> None:
        self.closed_to_make_room = True


@pytest.fixture
def conns() -> Iterator[list[_Conn]]:
    made = [_Conn() for _ in range(8)]
    yield made
    for c in made:
        c.server.close()
        c.client.close()


def test_the_oldest_of_a_source_past_its_cap_is_closed_other_sources_untouched(
    conns: list[_Conn],
) -> None:
    pending = HeadPending(per_source=3, total=100)
    pending.add(conns[0], "10.0.0.9", "api")
    for c in conns[1:5]:
        pending.add(c, "10.0.0.1", "api")
    assert [c.closed_to_make_room for c in conns[:5]] == [False, True, False, False, False]
    assert pending.count("10.0.0.1") == 3 and len(pending) == 4 and pending.closed == 1


def test_past_the_total_the_oldest_of_all_is_closed(conns: list[_Conn]) -> None:
    pending = HeadPending(per_source=3, total=4)
    for i, c in enumerate(conns[:6]):
        pending.add(c, f"10.0.0.{i}", "api")
    assert [c.closed_to_make_room for c in conns[:6]] == [True, True, False, False, False, False]
    assert len(pending) == 4


def test_one_whose_request_waits_unread_is_passed_over(conns: list[_Conn]) -> None:
    # a burst of new connections accepted before the loop reads any: the operator's, its
    # request already in its socket, is not taken for a silent one
    pending = HeadPending(per_source=2, total=100)
    operator, *flood = conns[:5]
    operator.client.sendall(b"GET /v1/health HTTP/1.1\r\n")
    pending.add(operator, "127.0.0.1", "api")
    for c in flood:
        pending.add(c, "127.0.0.1", "api")
    assert not operator.closed_to_make_room
    assert [c.closed_to_make_room for c in flood] == [True, True, True, False]


def test_one_waiting_again_after_a_response_is_the_newest(conns: list[_Conn]) -> None:
    pending = HeadPending(per_source=2, total=100)
    first, second, third = conns[:3]
    pending.add(first, "127.0.0.1", "api")
    pending.add(second, "127.0.0.1", "api")
    pending.discard(first)  # its request came
    pending.add(first, "127.0.0.1", "api")  # answered, kept alive: waiting again
    pending.add(third, "127.0.0.1", "api")
    assert (first.closed_to_make_room, second.closed_to_make_room) == (False, True)


def test_sources_are_addresses_and_ipv6_64s() -> None:
    assert source_key("127.0.0.1") == "127.0.0.1"
    assert source_key("::ffff:10.1.2.3") == "10.1.2.3"
    assert source_key("2001:db8:1:2:aaaa::1") == source_key("2001:db8:1:2:bbbb::2")
    assert source_key("2001:db8:1:2::1") == "2001:db8:1:2::/64"
    assert source_key("fe80::1%eth0") != source_key("fe80::2%eth0")

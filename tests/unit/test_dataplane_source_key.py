"""What the data plane's per-source cap on unauthenticated TCP connections
(``data_max_unauthenticated_per_source``) counts a client under: one IPv6 host may use any
address of its /64, so counting exact addresses let it hold the cap's share once per address
(and fill ``data_max_connections``, locking engines and peers out)."""

from __future__ import annotations

import pytest

from kvctl.connection_sources import source_key


def test_ipv6_addresses_of_one_64_are_one_source() -> None:
    a, b = source_key("2001:db8:1:2:aaaa::1"), source_key("2001:db8:1:2:ffff:ffff:ffff:fffe")
    assert a == b == "2001:db8:1:2::/64"
    assert source_key("2001:db8:1:3::1") != a  # the next /64 is another source
    assert source_key("2001:DB8:1:2::9%3") == a  # written otherwise, with a zone


def test_ipv4_is_counted_per_address_mapped_ones_too() -> None:
    assert source_key("10.1.2.3") == "10.1.2.3"
    assert source_key("10.1.2.4") != source_key("10.1.2.3")
    # a dual-stack listener sees IPv4 clients as IPv4-mapped IPv6: still their IPv4 address,
    # not one /64 (::ffff:0:0/64) shared by every IPv4 client
    assert source_key("::ffff:10.1.2.3") == "10.1.2.3"
    assert source_key("::ffff:10.1.2.4") == "10.1.2.4"


@pytest.mark.parametrize("host", ["fe80::1%eth0", "fe80::2%eth0"])
def test_link_local_addresses_count_one_each(host: str) -> None:
    # fe80::/64 is every host on the link, not one host's
    assert source_key(host) == host


def test_loopback() -> None:
    assert source_key("127.0.0.1") != source_key("127.0.0.2")
    assert source_key("::1") == "::/64"

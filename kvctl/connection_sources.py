"""Which source a client's connection counts under, for the caps on connections not yet
authenticated: the data plane's ``data_max_unauthenticated_per_source`` and the HTTP servers'
waiting connections. One definition, so the two caps count the same clients alike."""

from __future__ import annotations

import ipaddress


def source_key(host: str) -> str:
    """An IPv4 address as itself (an IPv4-mapped IPv6 one, from a dual-stack listener, as its
    IPv4), an IPv6 address by its /64, the least a site is given (one host can hold any number
    of addresses of its /64, each would have had a share of its own). A link-local address
    keeps its own (with its zone): its /64 is the whole link's, every host on it."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:  # not an address (never from accept; a Unix socket's peer): as given
        return host
    if isinstance(ip, ipaddress.IPv4Address):
        return str(ip)
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    if ip.is_link_local:
        return str(ip)
    return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))  # (a zone, if any, dropped)

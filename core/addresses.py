"""Network addresses: which ones stay on this machine."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an IP address, IPv6 with or without brackets) is this machine
    only: localhost or a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False

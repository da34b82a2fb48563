"""Whether a host name or address stays on this machine: what every server here checks before binding without a
token. Standard library only, so config validation can ask it on a node without the serving stack."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False

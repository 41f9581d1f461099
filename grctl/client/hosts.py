"""Is a server on this host? Then it can read a checkpoint this process can name (the auto
transport sends it the path: one copy, its page cache into its parameters, instead of staging
the bytes through shared memory first).

A URL's host is local when every address it resolves to is a loopback address or one this
machine can bind (one of its own interfaces). That says nothing about the server's filesystem:
a container reached through a published port sees its own; the auto transport therefore falls
back to staging when the server refuses the path.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
from urllib.parse import urlsplit


def is_local(url: str) -> bool:
    host = urlsplit(url if "//" in url else f"http://{url}").hostname
    return bool(host) and _host_is_local(host)


@functools.lru_cache(maxsize=64)
def _host_is_local(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    addresses = {info[4][0] for info in infos}
    return bool(addresses) and all(_is_own(a) for a in addresses)


def _is_own(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if ip.is_loopback:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((address, 0))  # only an address of this machine's interfaces binds
        return True
    except OSError:
        return False

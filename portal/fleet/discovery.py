"""Worker discovery from DNS: `dns://NAME:PORT` names a set of workers, one per address record.

A Kubernetes headless Service answers its name with one A (or AAAA) record per ready pod, so
resolving `dns://inference-headless:8001` on every poll tracks the StatefulSet as it scales,
rolls and drains (a pod whose /ready turns 503 leaves the answer). Each address becomes the
worker URL `http://ADDRESS:PORT`.

Resolution goes through the system resolver (getaddrinfo: /etc/hosts, the pod's resolv.conf
search domains), bounded by a timeout so a dead DNS server cannot stall the poll. This module
only resolves: no ORM, never raises for the name's sake (portal.fleet.services records what it
found and what failed on the WorkerDiscovery row).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from portal.config import DiscoveryName, parse_discovery

__all__ = ["DiscoveryName", "Resolution", "parse_discovery", "resolve_workers"]

RESOLVE_TIMEOUT_SECONDS = 5.0
# A headless Service of a large fleet has a few hundred records; more is a misconfiguration
# (or a hostile resolver) and would turn every poll into a flood of probes.
MAX_ADDRESSES = 512

Resolver = Callable[..., list]


@dataclass(frozen=True)
class Resolution:
    """What one lookup found: the worker URLs (sorted), or `error` saying why there are none."""

    spec: str
    urls: tuple[str, ...] = ()
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


def resolve_workers(name: DiscoveryName, *, resolver: Resolver = socket.getaddrinfo,
                    timeout: float = RESOLVE_TIMEOUT_SECONDS) -> Resolution:
    """Every address `name.host` resolves to, as worker URLs. Never raises."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleet-dns")
    future = pool.submit(resolver, name.host, name.port, type=socket.SOCK_STREAM)
    try:
        answers = future.result(timeout=timeout)
    except FutureTimeout:
        return Resolution(name.spec, error=f"{name.host}: no DNS answer within {timeout:g} s")
    except socket.gaierror as error:
        return Resolution(name.spec, error=f"{name.host} does not resolve: {error.strerror or error}")
    except (OSError, UnicodeError, ValueError) as error:
        return Resolution(name.spec, error=f"{name.host}: lookup failed: {error}")
    finally:
        # A lookup past its timeout keeps its thread until the resolver gives up; don't wait.
        pool.shutdown(wait=False)
    urls = set()
    for answer in answers:
        address = _address(answer)
        if address is None:
            return Resolution(name.spec, error=f"{name.host}: the resolver returned something that is not an "
                                                f"address: {str(answer)[:80]}")
        urls.add(_url(address, name.port))
    if not urls:
        return Resolution(name.spec, error=f"{name.host}: no address records")
    if len(urls) > MAX_ADDRESSES:
        return Resolution(name.spec, error=f"{name.host}: {len(urls)} addresses, more than {MAX_ADDRESSES}")
    return Resolution(name.spec, urls=tuple(sorted(urls)))


def _address(answer) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address in one getaddrinfo tuple (family, type, proto, canonname, sockaddr)."""
    try:
        host = answer[4][0]
        return ipaddress.ip_address(host.split("%", 1)[0])  # drop an IPv6 zone id
    except (TypeError, IndexError, ValueError, AttributeError):
        return None


def _url(address: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> str:
    host = f"[{address}]" if address.version == 6 else str(address)
    return f"http://{host}:{port}"

"""The address policy: which resolved addresses a connection may go to, whatever the name was.

Refused: every address that is not globally routable (private, loopback,
link-local, shared/CGNAT, documentation, benchmarking, reserved, unspecified,
unique-local IPv6), multicast, the cloud metadata addresses, and the operator's
extra ranges (the cluster's service and pod CIDRs, which may well be public
addresses). IPv6 forms that carry an IPv4 address (IPv4-mapped, 6to4, Teredo,
NAT64's well-known prefix) are judged by the IPv4 address they carry as well.

`allow_loopback` admits loopback addresses and nothing else; only the test
suite may turn it on (the settings refuse it otherwise).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from sandpool.egress.hosts import IPAddress

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

METADATA = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254",  # AWS, GCP, Azure, OpenStack, DigitalOcean...
    "169.254.170.2",  # AWS ECS task metadata
    "fd00:ec2::254",  # AWS IMDS over IPv6
    "100.100.100.200",  # Alibaba Cloud
    "192.0.0.192",  # Oracle Cloud
))
NAT64 = ipaddress.ip_network("64:ff9b::/96")


def embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries, for the forms that route to it."""
    if address.version != 6:
        return None
    assert isinstance(address, ipaddress.IPv6Address)
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def parse_networks(cidrs: Iterable[str]) -> tuple[Network, ...]:
    """Operator CIDRs (`10.96.0.0/12`); `ValueError` naming a bad one."""
    out = []
    for cidr in cidrs:
        try:
            out.append(ipaddress.ip_network(cidr.strip(), strict=False))
        except ValueError:
            raise ValueError(f"not a CIDR: {cidr!r}") from None
    return tuple(out)


@dataclass(frozen=True)
class AddressPolicy:
    denied: tuple[Network, ...] = ()
    allow_loopback: bool = False

    def refusal(self, address: IPAddress) -> str | None:
        """Why `address` is refused (a short word for messages and metrics), or None when admitted."""
        if address in METADATA:
            return "metadata"
        if any(address.version == net.version and address in net for net in self.denied):
            return "denied_range"
        inner = embedded_ipv4(address)
        if inner is not None:
            why = self.refusal(inner)
            if why is not None:
                return why
            assert isinstance(address, ipaddress.IPv6Address)  # only IPv6 addresses embed another
            if address.ipv4_mapped is not None or address in NAT64:
                return None  # that IPv4 address, reached directly or through the NAT64 gateway (DNS64)
        if address.is_loopback:
            return None if self.allow_loopback else "loopback"
        if address.is_unspecified:
            return "unspecified"
        if address.is_link_local:
            return "link_local"
        if address.is_multicast:
            return "multicast"
        if address.is_private:
            return "private"
        if address.is_reserved:
            return "reserved"
        if not address.is_global:
            return "not_global"
        return None

    def connectable(self, address: IPAddress) -> IPAddress:
        """The address to dial: an IPv4-mapped address as the IPv4 address it maps."""
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            return address.ipv4_mapped
        return address

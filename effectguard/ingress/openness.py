"""What ``serve`` warns of at start about who can reach what, once, before any request.

* A proxy off the loopback with no proxy keys lets anyone who can reach it spend, with
  effectguard's own provider keys where they are set (contract.md §1). That is the local
  default's rule, fine on 127.0.0.1 and rarely meant on 0.0.0.0.
* An operator page whose sessions are signed without ``EFFECTGUARD_ADMIN_SECRET`` can be
  logged into by whoever reads the config file's ``[admin]`` digests.
"""

from __future__ import annotations

import ipaddress
import logging
import socket

from effectguard.config.defaults import ADMIN_SECRET_ENV
from effectguard.config.settings import ServeSettings
from effectguard.ingress.keyring import KeyRing

log = logging.getLogger("effectguard.ingress.server")


def warn_at_start(settings: ServeSettings, keyring: KeyRing) -> None:
    """Log a warning for each door left open; nothing when none is."""
    if settings.admin.enabled and not settings.admin.secret:
        log.warning(
            "operator page: %s is not set, so whoever can read the config file can "
            "forge a login; set it (the same on every replica)",
            ADMIN_SECRET_ENV,
        )
    if not keyring.required and not loopback_only(settings.host):
        log.warning(
            "listening on %s with no proxy keys: anyone who can reach it spends, with "
            "effectguard's own provider keys where they are set; make a key (`effectguard "
            "key new`) or listen on 127.0.0.1",
            settings.host,
        )


def loopback_only(host: str) -> bool:
    """Whether every address ``host`` names is a loopback one (a wildcard is not)."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return True  # serve bound it already, so this is a lookup that changed: say nothing
    addresses = {str(info[4][0]).partition("%")[0] for info in found}
    return all(ipaddress.ip_address(address).is_loopback for address in addresses)

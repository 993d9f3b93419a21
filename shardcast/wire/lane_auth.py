"""wire: authenticated requests on the HTTP lane: a signed header binding PeerID, path and time.

The lane needs no trust for integrity (every byte is checked against the signed manifest),
but the origin's super-seeding (:class:`shardcast.serve.superseeding.SuperSeeding`) decides *who*
gets a
shard first, so it must know who asks. Each request of a node carries::

    X-Shardnet-Auth: <PeerID> <window> <signature, base64url>

where ``window`` is ``floor(unix_time / WINDOW_S)`` and the signature is the node's Ed25519
signature (domain ``lane-request``) of ``<window> <path>``. The server recovers the key from
the PeerID, accepts the current window and its neighbours (clock skew up to one window), and
otherwise treats the request as anonymous. A header seen on the wire can be replayed only for
the same path and for a minute at most, which gains nothing that the path did not already
give. Signing is cached per (path, window), so a node signs each path at most once per window.

Pure functions of their arguments (``now_unix`` is passed in); no I/O.
"""

from __future__ import annotations

import base64
import binascii
from collections import OrderedDict
from collections.abc import Callable, Sequence

from p2p.errors import IntegrityError
from p2p.http_checks import HOLDER_HEADER as HOLDER_HEADER
from p2p.http_checks import MAX_HOLDERS as MAX_HOLDERS
from p2p.http_checks import parse_holders
from p2p.keys import DomainSigner, verify

AUTH_HEADER = "x-shardnet-auth"
FAILED_HEADER = "x-shardnet-failed"
UNREACHABLE_HEADER = "x-shardnet-unreachable"
"""Request header: holders (PeerIDs, comma-separated, at most 4) a super-seeding refusal
named (:data:`HOLDER_HEADER`) that the requester has no lane to
(:class:`shardcast.serve.superseeding.SuperSeeding` rule 11). Older servers ignore it."""
WINDOW_S = 30
_DOMAIN = "lane-request"
_MAX_PEER_ID = 128


def _body(window: int, path: str) -> bytes:
    return f"{window} {path}".encode()


def sign_request(identity: DomainSigner, path: str, now_unix: float) -> str:
    """The ``X-Shardnet-Auth`` value for a request of ``path`` at ``now_unix`` (seconds)."""
    window = int(now_unix // WINDOW_S)
    sig = identity.sign(_DOMAIN, _body(window, path))
    return f"{identity.peer_id} {window} {base64.urlsafe_b64encode(sig).decode()}"


def verify_request(value: str | None, path: str, now_unix: float) -> str | None:
    """The authenticated PeerID of a request, or None (absent, malformed, stale or forged:
    the request is anonymous)."""
    if not value or len(value) > 512:
        return None
    fields = value.split(" ")
    if len(fields) != 3 or len(fields[0]) > _MAX_PEER_ID or not fields[1].isdigit():
        return None
    peer_id, window = fields[0], int(fields[1])
    if abs(window - int(now_unix // WINDOW_S)) > 1:
        return None
    try:
        sig = base64.urlsafe_b64decode(fields[2])
        verify(peer_id, _DOMAIN, _body(window, path), sig)
    except (IntegrityError, binascii.Error, ValueError):
        return None
    return peer_id


class RequestSigner:
    """Adds ``X-Shardnet-Auth`` to a node's requests (an :class:`~p2p.http_client.HttpClient`
    ``sign`` hook), caching one signature per (path, window); at most ``cache`` are kept.

    Args:
        identity: the node's key.
        clock: wall-clock seconds (``time.time``).
    """

    def __init__(
        self, identity: DomainSigner, clock: Callable[[], float], cache: int = 4096
    ) -> None:
        self.identity = identity
        self.clock = clock
        self.cache = cache
        self._signed: OrderedDict[tuple[str, int], str] = OrderedDict()

    def __call__(self, target: str) -> Sequence[tuple[str, str]]:
        now = self.clock()
        key = (target, int(now // WINDOW_S))
        value = self._signed.get(key)
        if value is None:
            value = sign_request(self.identity, target, now)
            self._signed[key] = value
            if len(self._signed) > self.cache:
                self._signed.popitem(last=False)
        return [(AUTH_HEADER, value)]


WHOAMI_DOMAIN = "lane-whoami"


def whoami_path(nonce: str) -> str:
    """The lane path of the identity challenge ``nonce`` (32 lowercase hex characters)."""
    return f"/shardnet/v1/whoami/{nonce}"


def whoami_body(nonce: str, url: str) -> bytes:
    """What a lane signs to prove that it answers at ``url`` (``http://host:port``) for its
    PeerID; ``nonce`` is the asker's fresh challenge."""
    return f"whoami {nonce} {url}".encode()


def sign_whoami(identity: DomainSigner, nonce: str, url: str) -> bytes:
    """The lane's answer to a challenge: ``<PeerID> <signature, base64url>``."""
    sig = identity.sign(WHOAMI_DOMAIN, whoami_body(nonce, url))
    return f"{identity.peer_id} {base64.urlsafe_b64encode(sig).decode()}".encode()


def check_whoami(answer: bytes, peer_id: str, nonce: str, url: str) -> bool:
    """True if ``answer`` proves that the lane at ``url`` holds ``peer_id``'s key."""
    fields = answer.decode("ascii", errors="replace").split(" ")
    if len(fields) != 2 or fields[0] != peer_id:
        return False
    try:
        verify(peer_id, WHOAMI_DOMAIN, whoami_body(nonce, url), base64.urlsafe_b64decode(fields[1]))
    except (IntegrityError, binascii.Error, ValueError):
        return False
    return True


def failed_header(sources: Sequence[str]) -> list[tuple[str, str]]:
    """The ``X-Shardnet-Failed`` header naming sources that failed this shard for the
    requester (at most 4), so the origin can release their reservation. Sources that are
    not nodes (a static mirror, named by its URL) hold no reservation and are left out."""
    ids = _ids(sources)
    return [(FAILED_HEADER, ",".join(ids))] if ids else []


def parse_failed(value: str | None) -> tuple[str, ...]:
    """The PeerIDs named in an ``X-Shardnet-Failed`` value (bounded)."""
    if not value or len(value) > MAX_HOLDERS * (_MAX_PEER_ID + 1):
        return ()
    return tuple(v for v in value.split(",")[:MAX_HOLDERS] if v)


def _ids(sources: Sequence[str]) -> list[str]:
    """The last :data:`MAX_HOLDERS` of ``sources`` that are node ids (not URLs)."""
    return [s for s in sources if 0 < len(s) <= _MAX_PEER_ID and not set(s) & set(",:/ ")][
        -MAX_HOLDERS:
    ]


def holder_header(holders: Sequence[str]) -> list[tuple[str, str]]:
    """The :data:`HOLDER_HEADER` of a super-seeding refusal naming ``holders`` (at most
    :data:`MAX_HOLDERS`, the first ones kept; none: no header, as an older server answers)."""
    ids = _ids(list(holders)[:MAX_HOLDERS])
    return [(HOLDER_HEADER, ",".join(ids))] if ids else []


def unreachable_header(holders: Sequence[str]) -> list[tuple[str, str]]:
    """The :data:`UNREACHABLE_HEADER` naming holders the requester cannot reach (the last
    :data:`MAX_HOLDERS`; URLs left out: a mirror holds no reservation)."""
    ids = _ids(holders)
    return [(UNREACHABLE_HEADER, ",".join(ids))] if ids else []


def parse_unreachable(value: str | None) -> tuple[str, ...]:
    """The PeerIDs an :data:`UNREACHABLE_HEADER` value names (bounded like
    :func:`p2p.http_checks.parse_holders`)."""
    return parse_holders(value)

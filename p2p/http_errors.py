"""Transport errors specific to the HTTP bulk lane.

The generic ones (``PeerUnreachable``, ``StreamBroken``, ``RemoteProtocolError``,
``MessageTooLarge``) live in :mod:`p2p.errors`; this module adds the one outcome the HTTP lane
has that a libp2p stream does not: a source that is reachable and healthy but does not hold the
requested bytes (yet).
"""

from __future__ import annotations

from p2p.errors import TransportError

__all__ = ["NotAvailable"]


class NotAvailable(TransportError):
    """The source answered, but does not have the bytes now (HTTP 404, 409, 429 or 503).

    Not a fault of the source: a relay that has not verified a shard yet, or is at its
    connection limit, says so; ``409``: it holds what the URL names under another identity
    (a version's step under another manifest digest). Callers should try another source or
    come back later.

    Args:
        peer: the source (``http://127.0.0.1:9000``).
        message: what the source said (status and path).
        retry_after_s: the source's ``Retry-After`` hint in seconds, or ``None`` when it gave
            none (a plain 404 may mean "never").
        status: the HTTP status code.
        holders: the nodes (PeerIDs) the source names as holding the bytes, to be fetched
            from instead (a super-seeding ``429``'s ``X-Shardnet-Holder``,
            :func:`p2p.http_checks.parse_holders`); empty when it named none.
    """

    def __init__(
        self,
        peer: str,
        message: str,
        *,
        retry_after_s: float | None = None,
        status: int = 503,
        holders: tuple[str, ...] = (),
    ) -> None:
        super().__init__(peer, message)
        self.retry_after_s = retry_after_s
        self.status = status
        self.holders = holders

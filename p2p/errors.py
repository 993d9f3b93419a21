"""One exception hierarchy for shardnet, split by whose fault it is.

Every package raises these (``p2p`` is the bottom layer, so all may import it). Library
exceptions (libp2p, h11, OS errors on sockets) are translated once, at the ``p2p``
boundary, into the transport errors below; nothing above ``p2p`` catches a libp2p type.

==========================  =====================================================
class                       meaning
==========================  =====================================================
``LocalProtocolError``      we were asked to do something invalid: our bug or bad config
``ConfigError``             a configuration value is invalid (names the field)
``RemoteProtocolError``     a remote peer broke the protocol (lowers its score)
``FieldError``              a field of a remote message is missing or out of bounds
``MalformedEnvelope``       a signed envelope that does not parse, or of another kind
``IntegrityError``          bytes do not match a digest, a signature does not verify
``BadSignature``            a signed envelope whose signature does not verify
``UntrustedSigner``         a valid signature from a PeerID that is not trusted
``VerificationError``       an item (rollout, proof) was rejected by a check
``PeerUnreachable``         could not dial / connect to a peer or an HTTP source
``StreamBroken``            an established stream/transfer ended early or timed out
``MessageTooLarge``         a frame or body exceeded the configured bound
``NotHeld``                 a request names what this node held once and dropped (no fault)
==========================  =====================================================
"""

from __future__ import annotations

import base58


class ShardnetError(Exception):
    """Base class of every error shardnet raises on purpose."""


class LocalProtocolError(ShardnetError):
    """We tried to do something the protocol does not allow (a bug or a bad call)."""


class ConfigError(ShardnetError):
    """A configuration value is invalid.

    Args:
        field: dotted name of the offending field (``relay.upstream``).
        message: what is wrong with it.
    """

    names_option = True
    """``field`` is a setting, which the CLI names as its command-line option (a subclass
    whose fields are of a file, such as a topology's, sets False)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class RemoteProtocolError(ShardnetError):
    """A remote peer sent something malformed or out of protocol.

    Args:
        peer: the remote's PeerID string or source label (``http://127.0.0.1:9000``),
            used for logging and scoring.
        message: what was wrong.
    """

    def __init__(self, peer: str, message: str) -> None:
        super().__init__(f"{short_id(peer)}: {message}")
        self.peer = peer


class FieldError(RemoteProtocolError):
    """A field of a remote message is missing, of the wrong type or out of bounds.

    Args:
        peer: who sent the message (PeerID, URL or path).
        message: what is wrong.
        field: the offending field (dotted for nested fields), ``""`` for the whole message.
    """

    def __init__(self, peer: str, message: str, field: str = "") -> None:
        super().__init__(peer, message)
        self.field = field

    @classmethod
    def for_field(cls, peer: str, field: str, message: str) -> FieldError:
        """The error for ``field`` (what :mod:`p2p.fields` raises; subclasses with another
        constructor override this)."""
        return cls(peer, f"field {field!r} {message}", field)


class MalformedEnvelope(RemoteProtocolError):
    """Bytes that are not a well-formed signed envelope (:mod:`p2p.envelope`) of the expected
    kind: too large, not canonical CBOR, wrong fields, version or kind."""


class IntegrityError(ShardnetError):
    """Bytes that do not match their digest, or a signature that does not verify.

    Args:
        what: what was checked (``shard 12 of model-00001-of-00002.safetensors``).
        source: who sent the bytes, if known (PeerID or URL); ``""`` otherwise.
    """

    def __init__(self, what: str, source: str = "") -> None:
        msg = f"integrity check failed: {what}"
        if source:
            msg += f" (from {short_id(source)})"
        super().__init__(msg)
        self.what = what
        self.source = source


class BadSignature(IntegrityError):
    """A signed envelope whose signature does not verify against its signer's key."""


class UntrustedSigner(IntegrityError):
    """A signature that verifies, but by a PeerID that is not trusted for this item."""


class VerificationError(ShardnetError):
    """An item was rejected by a verification check.

    Args:
        reason: a short, stable machine-readable reason (``bad_signature``, ``stale_step``).
        detail: free text for humans.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class TransportError(ShardnetError):
    """Base class of failures to move bytes; ``peer`` names the other end."""

    def __init__(self, peer: str, message: str) -> None:
        super().__init__(f"{short_id(peer)}: {message}")
        self.peer = peer


class PeerUnreachable(TransportError):
    """Could not connect to a peer or source at all."""


class PeerIdMismatch(PeerUnreachable):
    """The node at a dialed address did not prove the PeerID of the address's ``/p2p/`` part.

    Either the address names the wrong PeerID (a typo, or the node there has a new key), or
    its secure handshake failed. Retrying does not help until the address is corrected.
    """


class StreamBroken(TransportError):
    """A stream or transfer started but ended early, was reset or timed out."""


class ClosedMidBody(StreamBroken):
    """The peer closed the connection in order (not a reset, not a timeout) before the body
    reached the length its head declared. A lane server does that when a streamed body's
    producer ends short (:class:`p2p.http_body.StreamedBody`): for a batch of blobs, when the
    request's hold ran out before the next blob was verified there, right after a whole blob
    (:mod:`shardcast.core.batch`). A connection that dies for good also ends this way."""


class MessageTooLarge(RemoteProtocolError):
    """A frame, response or body exceeded the configured bound (the sender's fault)."""


class NotHeld(ShardnetError):
    """A request names something this node held and has since dropped (a rollout batch
    delivered and acknowledged, asked for again by a trainer restarted since): refused
    without blaming the asker, and logged at INFO (see :meth:`p2p.host.P2PNode.serve`)."""


BASE58_CHARS = frozenset(base58.BITCOIN_ALPHABET.decode("ascii"))
"""The characters of a PeerID's text form (base58btc, the ``base58`` library's alphabet)."""


def short_id(peer: str) -> str:
    """Shorten a PeerID for logs: the last 8 characters (``…K7mYU3q``); anything else (a
    URL, a path, a host name) is kept whole.

    Args:
        peer: a base58 PeerID, a URL, a path or any label.

    Returns:
        ``peer`` unchanged if it is short or not base58 (a PeerID is), else ``"*"`` and its
        last 8 characters.
    """
    if len(peer) <= 12 or not BASE58_CHARS.issuperset(peer):
        return peer
    return "*" + peer[-8:]

"""Who is trusted for what: the pinned trainer PeerID and optional allowlists.

Every node pins the trainer's PeerID: only manifests and version announcements signed by that
key are accepted, whichever relay or peer delivered them. Operators of a closed swarm may also
restrict which relays a node downloads from and which peers may submit rollouts (allowlists);
an empty allowlist means "anyone", which is the permissionless default — there, the signed
manifest and the rollout verification pipeline carry the trust, not the allowlist.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2p.errors import ConfigError, UntrustedSigner
from p2p.keys import is_valid_peer_id


@dataclass(frozen=True)
class TrustList:
    """The trust configuration of a node.

    Attributes:
        trainer: the pinned trainer PeerID (base58); signs manifests and announcements.
        relays: if non-empty, the only PeerIDs this node downloads shards from.
        submitters: if non-empty, the only PeerIDs whose rollouts a trainer accepts.
    """

    trainer: str
    relays: frozenset[str] = frozenset()
    submitters: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not is_valid_peer_id(self.trainer):
            raise ConfigError("trust.trainer", f"{self.trainer!r} is not an Ed25519 PeerID")
        for name, ids in (("trust.relays", self.relays), ("trust.submitters", self.submitters)):
            bad = [p for p in ids if not is_valid_peer_id(p)]
            if bad:
                raise ConfigError(name, f"not Ed25519 PeerIDs: {', '.join(sorted(bad))}")

    def require_trainer(self, signer: str, what: str) -> None:
        """Raise unless ``signer`` is the pinned trainer.

        Raises:
            UntrustedSigner: ``signer`` is another PeerID.
        """
        if signer != self.trainer:
            raise UntrustedSigner(f"{what} signed by {signer}, trainer is {self.trainer}", signer)

    def relay_allowed(self, peer_id: str) -> bool:
        """True if shards may be downloaded from ``peer_id``."""
        return not self.relays or peer_id in self.relays

    def submitter_allowed(self, peer_id: str) -> bool:
        """True if rollouts from ``peer_id`` may be considered at all."""
        return not self.submitters or peer_id in self.submitters

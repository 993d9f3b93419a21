"""publish: the files of the versions the standalone origin published, watched for changes,
across restarts.

Theory of operation
-------------------
``shardnet origin --watch`` hard-links a step's files from ``WATCH`` into its store where it
can, so a trainer that rewrites a published file in place changes the bytes the origin serves
under the signed manifest (see :mod:`.watchdir`). :class:`PublishedFiles` keeps the
:func:`~shardcast.publish.watchdir.fingerprint` of each published version (name, inode, size,
mtime of each file) and, at every scan of ``WATCH``, compares it with the files as they are.

A changed fingerprint is not proof: ``touch``, a backup tool restoring mtimes, or a data
directory copied elsewhere (new inodes) change it without changing a byte. So the files whose
fingerprint changed are re-hashed against the version's signed manifest (the cost of the
change, and only then); a version whose bytes differ is quarantined
(:meth:`~shardcast.store.store.VersionStore.quarantine`: removed, no longer served) and said at
ERROR (``published_files_changed``), one whose bytes match keeps being served under its new
fingerprint (``published_files_touched``, INFO).

The fingerprints are kept in ``versions/<run>/.watch-published.json`` (written whole by
:func:`~shardcast.store.files.replace_file` after each change), so a file rewritten while the
origin was down is found at its next start, before anything is served
(:meth:`PublishedFiles.start`). Versions without a kept fingerprint (published before this
file existed) are fingerprinted as they are then. Memory and the file are bounded by the
versions the store holds.

The same file keeps the newest step ever published (:attr:`PublishedFiles.newest`), which a
quarantine does not lower: a step number is published once. Without it an origin restarted
after quarantining its newest version(s) would take the store's newest remaining version as
where it stands and publish the rewritten ``WATCH/step-<N>/`` again, under a step number the
followers already hold with other bytes (they would replace their copy, and rollouts of two
models would carry one step number). Versions only go forward; a rewritten step stays out.

Every method blocks (scans, hashes): call them in a worker thread.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from p2p.errors import ShardnetError
from shardcast.publish.watchdir import Fingerprint, changed_files, fingerprint
from shardcast.store import file_matches, replace_file

if TYPE_CHECKING:
    from p2p.trust import TrustList
    from shardcast.store import VersionStore

log = logging.getLogger(__name__)

FINGERPRINTS_FILE = ".watch-published.json"
"""In the run's directory of the store: the fingerprints of the versions published."""


def encode_fingerprints(held: dict[int, Fingerprint], newest: int | None = None) -> bytes:
    """``held`` (and ``newest``, the newest step ever published, if known) as JSON bytes
    (schema 1), steps and files sorted."""
    doc: dict[str, object] = {
        "schema": 1,
        "steps": {str(step): sorted(list(f) for f in fp) for step, fp in sorted(held.items())},
    }
    if newest is not None:
        doc["newest"] = newest
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_fingerprints(data: bytes) -> tuple[dict[int, Fingerprint], int | None]:
    """The inverse of :func:`encode_fingerprints`: ``(held, newest)`` (``newest`` None in a
    file written before it was kept).

    Raises:
        ValueError: not JSON, another schema, an entry that is not
            ``[name, inode, size, mtime_ns]``, or a ``newest`` that is not a step number
            (the message starts ``bad fingerprint file``).
    """
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("schema") != 1:
            raise ValueError("not schema 1")
        newest = doc.get("newest")
        if newest is not None and (
            not isinstance(newest, int) or isinstance(newest, bool) or newest < 0
        ):
            raise ValueError(f"newest {newest!r}")
        out: dict[int, Fingerprint] = {}
        for step, files in doc.get("steps", {}).items():
            entries = set()
            for entry in files:
                name, ino, size, mtime = entry
                if not isinstance(name, str) or not all(
                    isinstance(x, int) and not isinstance(x, bool) for x in (ino, size, mtime)
                ):
                    raise ValueError(f"step {step}: entry {entry!r}")
                entries.add((name, ino, size, mtime))
            out[int(step)] = frozenset(entries)
    except (TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"bad fingerprint file: {exc}") from exc
    return out, newest


class PublishedFiles:
    """The fingerprints of the versions in ``store`` that the origin published from
    ``WATCH`` (module docstring).

    Args:
        store: the origin's version store.
        trust: the run's trust list (to re-verify a stored manifest before re-hashing).
    """

    def __init__(self, store: VersionStore, trust: TrustList) -> None:
        self.store, self.trust = store, trust
        self.path = store.run_dir / FINGERPRINTS_FILE
        self.held: dict[int, Fingerprint] = {}
        self.newest: int | None = None
        """The newest step ever published here (kept across restarts; a quarantine does not
        lower it): ``WATCH`` steps up to it are never published (again)."""

    def start(self) -> list[int]:
        """Fingerprint every committed version, check those with a kept fingerprint (files
        changed while the origin was down) and keep the result.

        Returns:
            the versions quarantined.
        """
        kept: dict[int, Fingerprint] = {}
        newest: int | None = None
        try:
            kept, newest = decode_fingerprints(self.path.read_bytes())
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            log.warning("watch_fingerprints_ignored path=%s error=%s", self.path, exc)
        committed = self.store.committed_steps()
        self.newest = max([*committed, *([] if newest is None else [newest])], default=None)
        self.held = {step: kept[step] for step in committed if step in kept}
        quarantined = self.check()  # scans each version once; the others once below
        for step in committed:
            if step not in kept and self.store.has(step):
                self.held[step] = self._now(step)
        if self.held != kept or self.newest != newest:
            self._save()
        return quarantined

    def add(self, step: int, files: Fingerprint | None = None) -> None:
        """Keep the fingerprint of ``step``, just published: ``files``, taken before its
        files were hashed (so a change while they were hashed is found at the next
        :meth:`check`), or else the files as they are now."""
        self.held[step] = files if files is not None else self._now(step)
        self.newest = step if self.newest is None else max(self.newest, step)
        self._save()

    def check(self) -> list[int]:
        """Compare every kept fingerprint with the files now; re-hash the changed files;
        quarantine the versions whose bytes changed; forget the versions no longer held.

        Returns:
            the versions quarantined.
        """
        before = dict(self.held)
        quarantined: list[int] = []
        for step in sorted(self.held):
            if not self.store.has(step):  # retention, or quarantined with its base just now
                del self.held[step]
                continue
            now = self._now(step)
            changed = changed_files(self.held[step], now)
            if not changed:
                continue
            differ = self._differ(step, changed)
            if differ:
                del self.held[step]
                log.error(
                    "published_files_changed step=%d files=%s hint=a published step's files "
                    "were rewritten in place (the origin hard-links them from WATCH); the "
                    "version no longer matches its signed manifest and is no longer served "
                    "here; write each step to a new directory",
                    step,
                    ",".join(differ),
                )
                quarantined += self.store.quarantine(step, "published files changed in place")
            else:
                log.info("published_files_touched step=%d files=%s", step, ",".join(changed))
                self.held[step] = now
        if self.held != before:
            self._save()
        return quarantined

    def _now(self, step: int) -> Fingerprint:
        return fingerprint(self.store.version_dir(step))

    def _differ(self, step: int, names: list[str]) -> list[str]:
        """Which of ``names`` (files of ``step`` whose fingerprint changed) no longer hold
        their signed bytes: gone, unreadable, or another digest. Files the manifest does not
        list are not served as the version's and do not count; a manifest that does not
        verify any more counts as every name."""
        try:
            manifest = self.store.load_manifest(step, self.trust)
        except (OSError, ShardnetError):
            return names
        listed = {f.name for f in manifest.header.files}
        vdir = self.store.version_dir(step)
        return [n for n in names if n in listed and not file_matches(vdir / n, manifest, n)]

    def _save(self) -> None:
        try:
            # durable: ``newest`` cannot be found again from the store once its version is
            # quarantined (one fsync per published step)
            replace_file(self.path, encode_fingerprints(self.held, self.newest), durable=True)
        except OSError as exc:
            log.warning("watch_fingerprints_unsaved path=%s error=%s", self.path, exc)

"""shardcast: verified checkpoint broadcast, as packages by job (see docs/architecture.md).

``wire`` (formats), ``core`` (sans-IO decisions), ``store``, ``serve``, ``node``, ``publish``
(the origin) and ``download`` (the follower). Import from a package's facade, e.g.
``from shardcast.download import Follower``; this module imports none of them.
"""

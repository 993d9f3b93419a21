"""shardnet entry points: the ``shardnet`` CLI, role runners and the demo.

This package composes the others (``p2p``, ``shardcast``, ``rollout``, ``trainer``,
``simulations``); nothing imports it.
"""

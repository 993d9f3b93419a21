"""Datasets shipped with shardnet (see ``arithmetic.py`` for how each is generated)."""

"""shardcast package."""

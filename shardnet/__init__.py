"""shardnet package."""

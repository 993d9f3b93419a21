"""p2p package."""

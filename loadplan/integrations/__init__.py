"""Adapters that put the registry in front of other inference engines' load-time decisions."""

"""Adapters that make an inference engine's own worker ask the registry at its instantiation point."""

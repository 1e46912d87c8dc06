"""Environments, multi-turn episodes, tools and the sandbox."""

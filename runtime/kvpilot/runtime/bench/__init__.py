"""`kvpilot bench`: a load generator for OpenAI-compatible endpoints (see cli.py)."""

from .cli import main

__all__ = ["main"]

"""opsadv's version (the package root re-exports it; core.info reports it)."""
__version__ = "0.1.0"

"""Checkers for notebooks 01-03 (attention)."""
__all__: list[str] = []

"""Helpers that several test modules share, one module per area; fixtures stay in the conftest.py files."""

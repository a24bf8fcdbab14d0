"""Gradient rules: reduce."""

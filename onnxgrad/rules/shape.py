"""Gradient rules: shape."""

"""Gradient rules: linalg."""

"""Gradient rules: conv."""

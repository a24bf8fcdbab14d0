"""Gradient rules: losses."""

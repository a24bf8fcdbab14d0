"""Gradient rules: norm."""

"""Converters from other frameworks' model formats to ONNX."""

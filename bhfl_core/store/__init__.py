"""Persistence: node states and messages (safetensors), atomic small files, tables."""

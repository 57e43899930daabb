"""Adapters for training frameworks; each imports its framework lazily (optional extras)."""

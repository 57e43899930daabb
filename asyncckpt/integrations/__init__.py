"""Optional adapters for training frameworks; each imports its framework lazily."""

"""The secure message layer: bytes, keys and channels. Knows nothing of learning."""

"""What the server never sees: differential privacy (`dp`, `accountant`) and secure aggregation.

This package is a library below the runtime: it imports numpy, cryptography and dp-accounting, and
nothing of hpcfed's server, client, strategies or tasks.
"""

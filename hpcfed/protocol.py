"""The runtime's message kinds and bundle conventions, shared by server and client.

`comm` moves (kind, header, tensors) and knows nothing of these meanings. Every message is checked
against `EXPECTED_TENSORS` before its contents are used: a bundle with an unknown tensor name, a
wrong dtype or a wrong shape is rejected and counted like a forged one.
"""

from __future__ import annotations

SETUP = 1  # client -> server: task setup payload ("setup/*"), client 0's initial model ("init/*")
SETUP_REPLY = 2  # server -> client: task reply ("setup/*"), resumed state ("state/*"), layout, start round
PARAMS = 3  # server -> client: "params" flat float32 model for a round (sync) or version (async)
UPDATE = 4  # client -> server: "params" flat float32, + "state/*" when a checkpoint asked for it
FINAL = 5  # server -> client: final model to evaluate and export
RESULT = 6  # client -> server: final metrics
STOP = 7  # server -> client: leave now (header: reason)
FAILED = 8  # client -> server: this client failed (header: error); the server ends the job naming it

NAMES = {SETUP: "SETUP", SETUP_REPLY: "SETUP_REPLY", PARAMS: "PARAMS", UPDATE: "UPDATE", FINAL: "FINAL",
         RESULT: "RESULT", STOP: "STOP", FAILED: "FAILED"}

SETUP_PREFIX = "setup/"
INIT_PREFIX = "init/"
STATE_PREFIX = "state/"
PARAMS_KEY = "params"


def split_prefixed(tensors: dict, prefix: str) -> dict:
    """The tensors whose names start with `prefix`, with the prefix removed."""
    n = len(prefix)
    return {k[n:]: v for k, v in tensors.items() if k.startswith(prefix)}


def prefixed(tensors: dict, prefix: str) -> dict:
    return {prefix + k: v for k, v in tensors.items()}

"""The runtime's message kinds and bundle conventions, shared by server and client.

`comm` moves (kind, header, tensors) and knows nothing of these meanings. Every message is checked
against `EXPECTED_TENSORS` before its contents are used: a bundle with an unknown tensor name, a
wrong dtype or a wrong shape is rejected and counted like a forged one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar

_T = TypeVar("_T")  # whatever a bundle's tensors are (numpy arrays on the wire)

SETUP = 1  # client -> server: task setup payload ("setup/*"), client 0's initial model ("init/*")
SETUP_REPLY = 2  # server -> client: task reply ("setup/*"), layout, start round, the shard to resume from
PARAMS = 3  # server -> client: the model for a round (sync) or version (async), see `params_tensors`
UPDATE = 4  # client -> server: the model (`params_tensors`); header "shard" when PARAMS said "checkpoint"
FINAL = 5  # server -> client: final model to evaluate and export
RESULT = 6  # client -> server: final metrics
STOP = 7  # server -> client: leave now (header: reason)
FAILED = 8  # client -> server: this client failed (header: error); the server ends the job naming it
CHECKPOINT = 9  # server -> client (async): write your state shard now (header: round)
CHECKPOINT_DONE = 10  # client -> server: shard written (header: round, digest, path); no state on the wire
EVICTED = 11  # server -> client: the last message to a misbehaving site (header: reason); it leaves
# Secure aggregation (privacy.secure_aggregation; hpcfed.server.secagg_round, hpcfed.client.secagg), one round:
SA_ADVERT = 12  # client -> server: two X25519 public keys (header: round, c, s, sig)
SA_KEYS = 13  # server -> client: the neighbours' adverts, relayed (header: round, adverts)
SA_SHARES = 14  # client -> server: Shamir shares sealed to each neighbour (header: round, to; tensor "shares")
SA_SHARES_FOR = 15  # server -> client: the shares sealed to it (header: round, from; tensor "shares")
SA_MASKED = 16  # client -> server: the masked fixed-point input (tensor "masked"; header: round, metrics, shard,
#                 next_advert: its keys for round + 1)
SA_UNMASK = 17  # server -> client: who is alive and who dropped, the neighbours' consistency signatures
#                 (header: round, alive, dropped, signatures[, next_adverts])
SA_REVEAL = 18  # client -> server: per neighbour a seed share or a key share, never both (header: round, answers;
#                 with next_adverts: next_to and tensor "shares", round + 1's, set up ahead)
SA_CHECK = 19  # server -> client: the survivor set, whose masked inputs it sums (header: round, survivors)
SA_SIGNED = 20  # client -> server: its signature over it, the consistency check (header: round, signature)
# Secure buffered async (hpcfed.server.secagg_buffer, hpcfed.client.secagg_buffer): a round among a buffer's members
SA_READY = 21  # client -> server: trained, ready to join a buffer (header: version it trained from)
SA_BUFFER = 22  # server -> client: join buffer b (header: round = b, members, version, staleness)

NAMES = {SETUP: "SETUP", SETUP_REPLY: "SETUP_REPLY", PARAMS: "PARAMS", UPDATE: "UPDATE", FINAL: "FINAL",
         RESULT: "RESULT", STOP: "STOP", FAILED: "FAILED", CHECKPOINT: "CHECKPOINT",
         CHECKPOINT_DONE: "CHECKPOINT_DONE", EVICTED: "EVICTED", SA_ADVERT: "SA_ADVERT", SA_KEYS: "SA_KEYS",
         SA_SHARES: "SA_SHARES", SA_SHARES_FOR: "SA_SHARES_FOR", SA_MASKED: "SA_MASKED", SA_UNMASK: "SA_UNMASK",
         SA_REVEAL: "SA_REVEAL", SA_CHECK: "SA_CHECK", SA_SIGNED: "SA_SIGNED", SA_READY: "SA_READY",
         SA_BUFFER: "SA_BUFFER"}

SETUP_PREFIX = "setup/"
INIT_PREFIX = "init/"
PARAMS_KEY = "params"


def params_key(dtype_name: str) -> str:
    """Tensor name of a model's flat buffer of one dtype: "params" for float32 (the only one an
    all-fp32 model has), "params:bfloat16", "params:float16", "params:int8" ... for the others."""
    return PARAMS_KEY if dtype_name == "float32" else f"{PARAMS_KEY}:{dtype_name}"


def params_tensors(groups: Mapping[str, _T]) -> dict[str, _T]:
    """A packed model (dtype name -> flat buffer, `ParamLayout.pack`) as bundle tensors."""
    return {params_key(name): buf for name, buf in groups.items()}


def params_groups(tensors: Mapping[str, _T], dtype_names: Iterable[str]) -> dict[str, _T]:
    """The packed model inside `tensors` for the layout's dtype groups (missing groups are absent)."""
    return {name: tensors[params_key(name)] for name in dtype_names if params_key(name) in tensors}


def is_params_key(name: str) -> bool:
    """True for the name of a model's flat buffer (any dtype), as `params_key` makes them."""
    return name == PARAMS_KEY or name.startswith(PARAMS_KEY + ":")


def split_prefixed(tensors: Mapping[str, _T], prefix: str) -> dict[str, _T]:
    """The tensors whose names start with `prefix`, with the prefix removed."""
    n = len(prefix)
    return {k[n:]: v for k, v in tensors.items() if k.startswith(prefix)}


def prefixed(tensors: Mapping[str, _T], prefix: str) -> dict[str, _T]:
    """The same tensors with `prefix` put before each name (undone by `split_prefixed`)."""
    return {prefix + k: v for k, v in tensors.items()}


# -- what each side accepts (SecureChannel.expect): anything else is dropped on arrival ----------
# what a client takes, from rank 0 only
SECAGG_SERVER_KINDS = frozenset({SA_KEYS, SA_SHARES_FOR, SA_CHECK, SA_UNMASK})
SECAGG_CLIENT_KINDS = frozenset({SA_ADVERT, SA_SHARES, SA_MASKED, SA_SIGNED, SA_REVEAL})
SERVER_KINDS = frozenset({SETUP_REPLY, PARAMS, FINAL, STOP, CHECKPOINT, EVICTED, SA_BUFFER}) | SECAGG_SERVER_KINDS
# what the server takes from a client
CLIENT_KINDS = frozenset({SETUP, UPDATE, RESULT, FAILED, CHECKPOINT_DONE, SA_READY}) | SECAGG_CLIENT_KINDS
UPDATE_MARGIN = 4  # an UPDATE may be 4 x the model's float32 bytes (params + optimizer moments + a best copy) ...
UPDATE_SLACK = 64 << 20  # ... + 64 MiB (task state: RNG, per-document vectors, and the JSON header)
SMALL_MESSAGE = 2 << 20  # RESULT / FAILED carry a header only (<= 1 MiB) and no model


def server_bounds(model_floats: int, num_clients: int, evicted: Iterable[int] = ()
                  ) -> tuple[dict[int, frozenset[int]], dict[int, int], int]:
    """After setup: (kinds by client rank, largest bundle by kind, inbox bytes per client). A
    client's inbox holds at most one UPDATE and a few small messages; a first chunk declaring
    more than its kind's bound is refused before any buffer is reserved. An `evicted` client
    (by id) may send nothing: what it sends is dropped on arrival, unread, and counted."""
    update = UPDATE_MARGIN * 4 * int(model_floats) + UPDATE_SLACK
    out = set(evicted)
    kinds = {rank: (frozenset() if rank - 1 in out else CLIENT_KINDS - {SETUP}) for rank in range(1, num_clients + 1)}
    small = {kind: SMALL_MESSAGE
             for kind in (RESULT, FAILED, CHECKPOINT_DONE, SA_ADVERT, SA_SHARES, SA_SIGNED, SA_REVEAL, SA_READY)}
    # A masked input is one uint32 per parameter plus the masked weight, and a header like UPDATE's.
    return kinds, {UPDATE: update, SA_MASKED: 4 * (int(model_floats) + 1) + SMALL_MESSAGE, **small}, \
        update + 3 * SMALL_MESSAGE

"""`hpcfed inspect FILE.h5`: a readable account of a checkpoint, an embedding export, or any HDF5 file."""

from __future__ import annotations

import json
from pathlib import Path

from hpcfed.store import checkpoint, embeddings


def inspect_file(path: str | Path) -> str:
    import h5py

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        with h5py.File(path, "r") as f:
            kind = f.attrs.get("format")
    except OSError as exc:
        raise checkpoint.CheckpointError(f"{path} is not a readable HDF5 file ({exc})") from None
    if kind == checkpoint.FORMAT:
        return _describe_checkpoint(path)
    if kind == embeddings.FORMAT:
        return _describe_export(path)
    return _describe_tree(path)


def _describe_checkpoint(path: Path) -> str:
    ckpt = checkpoint.load(path)  # verifies the checksum
    lines = [f"{path}: hpcfed checkpoint (checksum OK)",
             f"  round {ckpt.round}, server version {ckpt.version}",
             f"  config: {ckpt.config.get('name')} task={ckpt.config.get('task', {}).get('name')} "
             f"strategy={ckpt.config.get('strategy', {}).get('name')} seed={ckpt.config.get('seed')}"]
    header, arrays = ckpt.strategy
    lines.append(f"  strategy state: {json.dumps(header, default=str)[:200]}")
    lines += [f"    {name}: {a.dtype} {list(a.shape)}" for name, a in arrays.items()]
    for cid, (head, arrs) in sorted(ckpt.clients.items()):
        total = sum(a.nbytes for a in arrs.values())
        lines.append(f"  client {cid}: {len(arrs)} state arrays, {total} bytes; {json.dumps(head, default=str)[:120]}")
    if ckpt.meta:
        lines.append(f"  meta: {json.dumps(ckpt.meta, default=str)[:300]}")
    return "\n".join(lines)


def _describe_export(path: Path) -> str:
    import h5py

    lines = [f"{path}: hpcfed embedding export"]
    with h5py.File(path, "r") as f:
        lines.append("  " + ", ".join(f"{k}={_plain(v)}" for k, v in f.attrs.items()))
        entities = [k for k in f.keys() if isinstance(f[k], h5py.Group)]
    for entity in entities:
        emb = embeddings.read_export(path, entity)
        lines.append(f"  /{entity}: vectors {emb.vectors.shape[0]} x {emb.vectors.shape[1]} float32, "
                     f"labels {'yes' if emb.labels is not None else 'no'}")
        lines.append("    " + ", ".join(f"{k}={_plain(v)}" for k, v in emb.attrs.items()))
        if emb.ids:
            lines.append(f"    first ids: {emb.ids[:5]}")
    return "\n".join(lines)


def _describe_tree(path: Path) -> str:
    import h5py

    lines = [f"{path}: HDF5 file (not an hpcfed format)"]
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: lines.append(
            f"  /{name}: {obj.dtype} {list(obj.shape)}" if isinstance(obj, h5py.Dataset) else f"  /{name}/"))
    return "\n".join(lines)


def _plain(value: object) -> object:
    return value.item() if hasattr(value, "item") else value

"""`hpcfed inspect FILE.h5`: a readable account of a checkpoint, a site shard, an embedding export,
or any HDF5 file.

Every file is read through `hpcfed.store.sealed` (links, external and virtual datasets refused,
every declared size bounded), so a hostile file gives one plain error line. With the job key in
``$HPCFED_STATE_KEY`` the file's tag is verified; without it the output says "not verified".
"""

from __future__ import annotations

import json
from pathlib import Path

from hpcfed.store import checkpoint, embeddings, sealed, site_state


def inspect_file(path: str | Path) -> str:
    """A human-readable description of an hpcfed HDF5 file (checkpoint, site shard, export, model), for
    `hpcfed inspect`; its tag is checked, not required."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    tree = sealed.read(path, None, require_auth=False)  # bounded; the tag is checked below
    kind = tree.attrs.get("", {}).get("format")
    if kind == checkpoint.FORMAT:
        return _describe_checkpoint(path)
    if kind == embeddings.FORMAT:
        return _describe_export(path)
    if kind == site_state.FORMAT:
        return _describe_shard(path)
    return _describe_tree(tree)


def _describe_shard(path: Path) -> str:
    tree = sealed.read(path, _key("site-shard"), require_auth=False)
    root = tree.attrs.get("", {})
    lines = [f"{path}: hpcfed site shard of client {root.get('client')}, round {root.get('round')} "
             f"({_verdict(tree.verified)}); digest {tree.digest.hex()}"]
    lines += [f"  /{name}: {a.dtype} {list(a.shape)}" for name, a in sorted(tree.datasets.items())]
    return "\n".join(lines)


def _key(purpose: str) -> sealed.FileAuth | None:
    return embeddings.export_auth(purpose)


def _verdict(verified: bool) -> str:
    if verified:
        return "authenticated with the job key"
    return "checksum OK, not verified: set HPCFED_STATE_KEY to the job's PSK"


def _describe_checkpoint(path: Path) -> str:
    ckpt = checkpoint.load(path, _key("checkpoint"))
    lines = [f"{path}: hpcfed checkpoint ({_verdict(ckpt.verified)})",
             f"  round {ckpt.round}, server version {ckpt.version}",
             f"  config: {ckpt.config.get('name')} task={ckpt.config.get('task', {}).get('name')} "
             f"strategy={ckpt.config.get('strategy', {}).get('name')} seed={ckpt.config.get('seed')}"]
    header, arrays = ckpt.strategy
    lines.append(f"  strategy state: {json.dumps(header, default=str)[:200]}")
    lines += [f"    {name}: {a.dtype} {list(a.shape)}" for name, a in arrays.items()]
    for cid, ref in sorted(ckpt.sites.items()):
        lines.append(f"  client {cid}: shard {ref['path']} (kept by the site), digest {ref['digest'][:16]}...")
    if ckpt.meta:
        lines.append(f"  meta: {json.dumps(ckpt.meta, default=str)[:300]}")
    return "\n".join(lines)


def _describe_export(path: Path) -> str:
    auth = embeddings.export_auth()
    tree = sealed.read(path, auth, require_auth=False)
    lines = [f"{path}: hpcfed embedding export ({_verdict(tree.verified)})"]
    root = {k: v for k, v in tree.attrs.get("", {}).items()}
    lines.append("  " + ", ".join(f"{k}={_plain(v)}" for k, v in root.items()))
    for entity in [g for g in tree.children("") if g in tree.groups]:
        emb = embeddings.read_export(path, entity, auth)
        lines.append(f"  /{entity}: vectors {emb.vectors.shape[0]} x {emb.vectors.shape[1]} float32, "
                     f"labels {'yes' if emb.labels is not None else 'no'}")
        lines.append("    " + ", ".join(f"{k}={_plain(v)}" for k, v in emb.attrs.items()))
        if emb.ids:
            lines.append(f"    first ids: {emb.ids[:5]}")
    return "\n".join(lines)


def _describe_tree(tree: sealed.Tree) -> str:
    lines = [f"{tree.path}: HDF5 file (not an hpcfed format)"]
    for name in sorted({*tree.groups, *tree.datasets} - {""}):
        if name in tree.datasets:
            a = tree.datasets[name]
            lines.append(f"  /{name}: {a.dtype} {list(a.shape)}")
        else:
            lines.append(f"  /{name}/")
    return "\n".join(lines)


def _plain(value: object) -> object:
    return value.item() if hasattr(value, "item") else value

"""Identity key files: keygen, permissions, authorized_keys parsing, and their use in a handshake."""

from __future__ import annotations

import os
import stat

import pytest

from hpcfed.cli.commands import main as cli_main
from hpcfed.comm import crypto
from hpcfed.comm.keys import generate_identity, load_authorized_keys, load_identity, load_public_keys


def test_generate_writes_a_private_key_only_the_owner_reads(tmp_path):
    path = tmp_path / "site1"
    line = generate_identity(path, comment="site1@test")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert line.startswith("hpcfed-ed25519 ") and line.endswith(" site1@test")
    assert (tmp_path / "site1.pub").read_text().strip() == line
    key = load_identity(path)
    [pub] = load_public_keys(tmp_path / "site1.pub")
    assert crypto.public_raw(pub) == crypto.public_raw(key)
    msg = b"signed"
    pub.verify(key.sign(msg), msg)


def test_generate_refuses_to_overwrite_unless_forced(tmp_path):
    path = tmp_path / "k"
    first = generate_identity(path)
    with pytest.raises(ValueError, match="--force"):
        generate_identity(path)
    assert generate_identity(path, overwrite=True) != first


def test_load_identity_refuses_a_key_others_can_read(tmp_path):
    path = tmp_path / "k"
    generate_identity(path)
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        load_identity(path)


def test_load_identity_explains_missing_and_foreign_files(tmp_path):
    with pytest.raises(ValueError, match="hpcfed keygen"):
        load_identity(tmp_path / "nope")
    junk = tmp_path / "junk"
    junk.write_text("not a key")
    os.chmod(junk, 0o600)
    with pytest.raises(ValueError, match="not an hpcfed"):
        load_identity(junk)


def test_authorized_keys_file_with_comments_and_errors_named_by_line(tmp_path):
    lines = [generate_identity(tmp_path / f"s{i}") for i in range(3)]
    auth = tmp_path / "authorized_keys"
    auth.write_text("# sites\n\n" + "\n".join(lines) + "\n")
    assert len(load_public_keys(auth)) == 3
    auth.write_text(lines[0] + "\nssh-ed25519 AAAA bob\n")
    with pytest.raises(ValueError, match=r"authorized_keys:2: expected 'hpcfed-ed25519"):
        load_public_keys(auth)
    auth.write_text("hpcfed-ed25519 AAAA\n")
    with pytest.raises(ValueError, match=r":1: the key decodes to 3 bytes"):
        load_public_keys(auth)
    auth.write_text("hpcfed-ed25519 !!!\n")
    with pytest.raises(ValueError, match=r":1: the key is not valid base64"):
        load_public_keys(auth)
    auth.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no public keys"):
        load_public_keys(auth)


def test_keygen_main(tmp_path, capsys):
    assert cli_main(["keygen", str(tmp_path / "id"), "--comment", "x"]) == 0
    out = capsys.readouterr().out
    assert "hpcfed-ed25519" in out and (tmp_path / "id.pub").exists()
    assert " rank=N x" in out and "MPI rank" in out  # the hint says how to bind the key to its rank


def test_authorized_keys_bind_each_key_to_one_rank(tmp_path):
    lines = [generate_identity(tmp_path / f"s{i}", comment=f"site{i}") for i in range(3)]
    kind_b64 = [" ".join(line.split()[:2]) for line in lines]
    auth = tmp_path / "authorized_keys"
    auth.write_text(f"# sites\n{kind_b64[0]} rank=1 site0\n\n{kind_b64[1]} rank=2\n{kind_b64[2]} rank=3 x y\n")
    bound = load_authorized_keys(auth)
    assert sorted(bound) == [1, 2, 3]
    assert crypto.public_raw(bound[2]) == crypto.public_raw(load_public_keys(tmp_path / "s1.pub")[0])
    auth.write_text("\n".join(lines) + "\n")  # an old file, without ranks: says how to fix it
    with pytest.raises(ValueError, match=r"authorized_keys:1: the key is not bound to one site rank; .*rank=N"):
        load_authorized_keys(auth)
    for bad, why in [(f"{kind_b64[0]} rank=1\n{kind_b64[1]} rank=1\n", ":2: rank 1 is listed twice"),
                     (f"{kind_b64[0]} rank=1\n{kind_b64[0]} rank=2\n", ":2: this key is already bound to rank 1"),
                     (f"{kind_b64[0]} rank=0\n", ":1: the key is not bound"),
                     (f"{kind_b64[0]} rank=1 rank=2\n", ":1: the key is not bound"),
                     (f"{kind_b64[0]} rank=x\n", ":1: the key is not bound")]:
        auth.write_text(bad)
        with pytest.raises(ValueError, match=why):
            load_authorized_keys(auth)

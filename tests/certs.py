"""Test certificates made with the `openssl` command: a CA, a server and a client certificate it signed,
and a second, unrelated CA with its own client certificate (the one a server must refuse).

Keys are P-256 (fast to make); the server certificate names 127.0.0.1 and
localhost, so clients check it against the address they dial.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

OPENSSL = shutil.which("openssl")
_NEW_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA nobody trusts
    other_client_cert: Path  # signed by other_ca
    other_client_key: Path


def _run(*args: str, cwd: Path) -> None:
    assert OPENSSL is not None, "the openssl command is needed to make test certificates"
    done = subprocess.run([OPENSSL, *args], cwd=cwd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"openssl {' '.join(args)} failed:\n{done.stderr}"


def _ca(directory: Path, name: str) -> None:
    _run(
        "req", "-x509", *_NEW_KEY, "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
        "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=directory,
    )  # fmt: skip


def _leaf(directory: Path, name: str, ca: str, extensions: str) -> None:
    (directory / f"{name}.ext").write_text(extensions, encoding="utf-8")
    _run("req", "-new", *_NEW_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=directory)
    _run(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
        "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=directory,
    )  # fmt: skip


def make_certs(directory: Path) -> Certs:
    directory.mkdir(parents=True, exist_ok=True)
    _ca(directory, "ca")
    _ca(directory, "other-ca")
    leaf = "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
    _leaf(directory, "server", "ca", leaf + "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _leaf(directory, "client", "ca", leaf + "extendedKeyUsage=clientAuth\n")
    _leaf(directory, "other-client", "other-ca", leaf + "extendedKeyUsage=clientAuth\n")
    d = directory
    return Certs(
        d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key",
        d / "other-ca.pem", d / "other-client.pem", d / "other-client.key",
    )  # fmt: skip

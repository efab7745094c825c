"""Certificates and keys for the local control plane, made with the openssl command line.

A private CA signs the apiserver's serving certificate and an admin client certificate in the
system:masters group; the service-account key pair signs and verifies ServiceAccount tokens.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from hack.devcluster.errors import DevClusterError

SERVING_SANS = "IP:127.0.0.1,DNS:localhost,IP:10.96.0.1,DNS:kubernetes,DNS:kubernetes.default.svc"


@dataclass(frozen=True)
class Pki:
    dir: Path

    @property
    def ca_crt(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    def crt(self, name: str) -> Path:
        return self.dir / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.dir / f"{name}.key"

    @property
    def sa_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.dir / "sa.pub"


def openssl(*args: str, log: Path) -> None:
    if shutil.which("openssl") is None:
        raise DevClusterError("openssl is missing: install it (Debian package 'openssl')")
    with log.open("a") as out:
        done = subprocess.run(["openssl", *args], stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise DevClusterError(f"openssl {args[0]} failed", log)


def make_pki(pki_dir: Path, log: Path) -> Pki:
    """Create CA, apiserver serving cert, admin client cert and SA keys (idempotent)."""
    pki = Pki(pki_dir)
    if pki.sa_pub.exists():
        return pki
    pki_dir.mkdir(parents=True, exist_ok=True)
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "3650",
        "-keyout",
        str(pki.ca_key),
        "-out",
        str(pki.ca_crt),
        "-subj",
        "/CN=kvpilot-dev-ca",
        log=log,
    )
    signed_cert(
        pki,
        "apiserver",
        "/CN=kube-apiserver",
        f"subjectAltName={SERVING_SANS}\nextendedKeyUsage=serverAuth",
        log,
    )
    signed_cert(
        pki, "admin", "/O=system:masters/CN=kvpilot-admin", "extendedKeyUsage=clientAuth", log
    )
    openssl("genrsa", "-out", str(pki.sa_key), "2048", log=log)
    openssl("rsa", "-in", str(pki.sa_key), "-pubout", "-out", str(pki.sa_pub), log=log)
    return pki


def signed_cert(pki: Pki, name: str, subject: str, extensions: str, log: Path) -> None:
    csr = pki.dir / f"{name}.csr"
    ext = pki.dir / f"{name}.ext"
    ext.write_text(extensions + "\n")
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(pki.key(name)),
        "-out",
        str(csr),
        "-subj",
        subject,
        log=log,
    )
    openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(pki.ca_crt),
        "-CAkey",
        str(pki.ca_key),
        "-CAcreateserial",
        "-days",
        "3650",
        "-out",
        str(pki.crt(name)),
        "-extfile",
        str(ext),
        log=log,
    )

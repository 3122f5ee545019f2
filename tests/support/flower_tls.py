"""TLS certificates and SuperNode authentication keys for local Flower 1.41 deployments.

Made with the ``cryptography`` package, for tests only (nothing is password-protected)::

    from tests.support.flower_tls import make_tls_material

    tls = make_tls_material(tmp_path / "tls", num_node_keys=3)
    with local_deployment(app_dir, 3, None, flwr_home, tls=tls, node_auth=True) as dep:
        ...

What Flower 1.41 expects (read from its source and checked against the real processes):

* SuperLink: ``--ssl-ca-certfile CA --ssl-certfile CERT --ssl-keyfile KEY`` (PEM). One HTTPS
  port serves the Fleet, Control and Runtime APIs, so the server certificate must name the
  address every client dials: the SuperNodes, the ``flwr`` CLI and the SuperLink's own
  SuperExec/``flwr-serverapp`` (which dial ``127.0.0.1:<port>`` and trust ``--ssl-ca-certfile``).
  Hence the SANs ``IP:127.0.0.1`` and ``DNS:localhost``.
* SuperNodes and the ``flwr`` CLI verify that certificate against the CA certificate
  (``--root-certificates CA`` / ``root-certificates = "CA"`` in ``$FLWR_HOME/config.toml``).
* SuperNode authentication: an EC key pair on a NIST curve (P-384 here, as in Flower's docs),
  the private key in OpenSSH format (``flower-supernode --auth-supernode-private-key``, read
  with ``load_ssh_private_key``), the public key in OpenSSH format (``ecdsa-sha2-nistp384
  ...``), the file ``flwr supernode register`` takes. Same as ``ssh-keygen -t ecdsa -b 384
  -N "" -f KEY``.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["NodeKey", "TlsMaterial", "make_node_key", "make_tls_material"]

DEFAULT_HOSTS = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class NodeKey:
    """One SuperNode's authentication key pair (OpenSSH format files).

    Attributes
    ----------
    private_key : Path
        For ``flower-supernode --auth-supernode-private-key`` (mode 0600).
    public_key : Path
        For ``flwr supernode register <public_key> <connection>``.
    """

    private_key: Path
    public_key: Path

    def public_key_text(self) -> str:
        """The public key line (``ecdsa-sha2-nistp384 AAAA...``)."""
        return self.public_key.read_text(encoding="ascii").strip()


@dataclass(frozen=True)
class TlsMaterial:
    """A self-signed CA, a server certificate it signed, and SuperNode key pairs.

    Attributes
    ----------
    folder : Path
        Where the files are.
    ca_cert : Path
        CA certificate (PEM): ``--ssl-ca-certfile`` of the SuperLink, ``--root-certificates``
        of the SuperNodes and ``root-certificates`` of the ``flwr`` CLI connection.
    server_cert : Path
        Server certificate (PEM) for 127.0.0.1/localhost: ``--ssl-certfile``.
    server_key : Path
        Its private key (PEM, PKCS#8, unencrypted): ``--ssl-keyfile``.
    node_keys : list[NodeKey]
        One authentication key pair per SuperNode, in SuperNode order.
    """

    folder: Path
    ca_cert: Path
    server_cert: Path
    server_key: Path
    node_keys: list[NodeKey] = field(default_factory=list)


def _write(path: Path, data: bytes, private: bool = False) -> Path:
    path.write_bytes(data)
    if private:
        path.chmod(0o600)
    return path


def _san(hosts: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def make_node_key(folder: Path, name: str = "supernode") -> NodeKey:
    """Write a new P-384 key pair ``<name>`` (private) and ``<name>.pub`` (public) in ``folder``.

    Parameters
    ----------
    folder : Path
        Created if missing.
    name : str, default "supernode"
        File name stem.

    Returns
    -------
    NodeKey
        The two paths.
    """
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private = _write(
        folder / name,
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        ),
        private=True,
    )
    public = _write(
        folder / f"{name}.pub",
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        + b"\n",
    )
    return NodeKey(private, public)


def make_tls_material(
    folder: Path,
    num_node_keys: int = 0,
    *,
    hosts: Sequence[str] = DEFAULT_HOSTS,
    days: int = 2,
) -> TlsMaterial:
    """Make a CA, a server certificate for ``hosts`` and ``num_node_keys`` node key pairs.

    Files written in ``folder``: ``ca.crt``, ``ca.key``, ``server.crt``, ``server.key``,
    ``supernode-<i>`` and ``supernode-<i>.pub``.

    Parameters
    ----------
    folder : Path
        Created if missing.
    num_node_keys : int, default 0
        SuperNode authentication key pairs to make.
    hosts : Sequence[str], default ("127.0.0.1", "localhost")
        Subject alternative names of the server certificate (IP addresses become IP SANs,
        the rest DNS SANs); the first one is also its common name.
    days : int, default 2
        Validity of both certificates (from one hour ago, against clock skew).

    Returns
    -------
    TlsMaterial
        The paths.
    """
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    start = datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=1)
    end = start + datetime.timedelta(days=days, hours=1)

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedparity test CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA384())
    )

    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(_san(hosts)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(server_key.public_key()), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
            critical=False,
        )
        .sign(ca_key, hashes.SHA384())
    )

    pem = serialization.Encoding.PEM
    pkcs8 = serialization.PrivateFormat.PKCS8
    plain = serialization.NoEncryption()
    ca_path = _write(folder / "ca.crt", ca_cert.public_bytes(pem))
    _write(folder / "ca.key", ca_key.private_bytes(pem, pkcs8, plain), private=True)
    cert_path = _write(folder / "server.crt", server_cert.public_bytes(pem))
    key_path = _write(folder / "server.key", server_key.private_bytes(pem, pkcs8, plain), True)
    node_keys = [make_node_key(folder, f"supernode-{i}") for i in range(num_node_keys)]
    return TlsMaterial(folder, ca_path, cert_path, key_path, node_keys)

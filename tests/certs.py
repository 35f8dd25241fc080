"""A certificate authority made in the test (cryptography), and server certificates it signs: what cert-manager's
CA issuer gives a cluster (a `kubernetes.io/tls` Secret with tls.crt, tls.key and ca.crt)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    pkcs8 = serialization.PrivateFormat.PKCS8
    return key.private_bytes(serialization.Encoding.PEM, pkcs8, serialization.NoEncryption())


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


class TestCA:
    """A self-signed CA; `issue(hosts)` signs a server certificate for DNS names and IP addresses."""

    __test__ = False  # not a pytest class

    def __init__(self, common_name: str = "rlfleet test CA"):
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(_name(common_name))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def write(self, path: Path) -> Path:
        """The CA certificate as a PEM bundle file (a client's RLFLEET_TLS_CA_FILE)."""
        path.write_bytes(self.pem)
        return path

    def issue(self, hosts: list[str]) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM) of a server known by `hosts` (DNS names or IP addresses)."""
        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(hosts[0]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)

    def issue_files(self, hosts: list[str], directory: Path, stem: str = "server") -> tuple[Path, Path]:
        """`issue` written as DIRECTORY/STEM.crt and STEM.key: a server's --tls-cert-file and --tls-key-file."""
        cert, key = self.issue(hosts)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"{stem}.crt").write_bytes(cert)
        (directory / f"{stem}.key").write_bytes(key)
        return directory / f"{stem}.crt", directory / f"{stem}.key"

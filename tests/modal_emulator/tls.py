"""The emulator's own certificate authority and the server certificate of its tunnels.

Modal serves a sandbox's encrypted port at `https://<host>:<port>` with a certificate
of a public CA. The emulator makes a CA of its own at start (EC P-256, valid for 30
days), writes it to `ca.pem` for the processes that must trust it (`SSL_CERT_FILE`), and
signs one server certificate for the tunnel host (an IP address or a DNS name; 127.0.0.1
and localhost are always in it). The keys never leave the emulator's state directory.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALID_DAYS = 30


@dataclass(frozen=True)
class TunnelCertificates:
    ca_file: Path
    cert_file: Path
    key_file: Path

    def server_context(self, alpn: list[str]) -> ssl.SSLContext:
        """A TLS server context with the tunnel certificate (and its CA, as a chain)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert_file, self.key_file)
        context.set_alpn_protocols(alpn)
        return context

    def client_context(self) -> ssl.SSLContext:
        """A TLS client context that trusts the emulator's CA only (for tests)."""
        return ssl.create_default_context(cafile=str(self.ca_file))


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "openalice modal emulator"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(["127.0.0.1", "localhost", *hosts]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def make_certificates(directory: Path, hosts: list[str]) -> TunnelCertificates:
    """Write `ca.pem`, `tunnel.pem` and `tunnel-key.pem` into `directory` (made if needed)."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    not_before, not_after = (
        now - datetime.timedelta(hours=1),
        now + datetime.timedelta(days=_VALID_DAYS),
    )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("openalice modal emulator CA")
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
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
        .sign(ca_key, hashes.SHA256())
    )

    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("openalice modal emulator tunnel"))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_san(hosts), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )

    pem = serialization.Encoding.PEM
    certificates = TunnelCertificates(
        ca_file=directory / "ca.pem",
        cert_file=directory / "tunnel.pem",
        key_file=directory / "tunnel-key.pem",
    )
    certificates.ca_file.write_bytes(ca_cert.public_bytes(pem))
    # The chain a client receives: the leaf, then its CA.
    certificates.cert_file.write_bytes(cert.public_bytes(pem) + ca_cert.public_bytes(pem))
    certificates.key_file.touch(mode=0o600)
    certificates.key_file.write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return certificates

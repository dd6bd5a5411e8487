"""The job's public host as a sandbox reaches it: `https://<SPACE_HOST>/...` on port 443 of a loopback address, TLS
terminated with a certificate from a CA made for the test, `Authorization` stripped as the HF Jobs proxy does
(tests/stubs/jobs_proxy_double.py), forwarded to the capture gateway's port.

The sandbox image trusts that CA and resolves the host through one extra overlay layer (`trust_layer`): the image's
CA bundle plus the test CA, and an /etc/hosts line for the host. That bundle is all OpenCode needs: the 1.18.33
binary is Bun 1.3.14 compiled with `--use-system-ca` (the plain Bun runtime in it, `BUN_BE_BUN=1`, trusts only its
built-in roots and refuses the front: `unable to verify the first certificate`, until NODE_EXTRA_CA_CERTS,
SSL_CERT_FILE or NODE_USE_SYSTEM_CA=1 points it at the bundle); curl and Python read the bundle too. A real job needs
none of this: the Jobs proxy's certificate chains to a public root. Key material lives under the test's tmp_path only.
"""

from __future__ import annotations

import datetime
import ipaddress
import random
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from stubs import jobs_proxy_double

BUNDLE = "etc/ssl/certs/ca-certificates.crt"  # Debian's bundle (update-ca-certificates), in the image root


@dataclass(frozen=True)
class Certs:
    ca: Path  # the CA certificate (PEM), what the image is made to trust
    cert: Path  # the host's certificate, signed by the CA
    key: Path


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_certs(folder: Path, host: str) -> Certs:
    """A fresh CA and a certificate for `host` signed by it, written under `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("chain test CA")).issuer_name(_name("chain test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(_name(host)).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    certs = Certs(folder / "ca.pem", folder / "host.pem", folder / "host.key")
    certs.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    certs.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    certs.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption()))
    certs.key.chmod(0o600)
    return certs


def loopback_address() -> str:
    """A loopback address of its own (all of 127/8 is loopback on Linux), so port 443 on it is free."""
    return str(ipaddress.IPv4Address("127.0.0.0") + random.randrange(2 << 16, 1 << 24))


def trust_layer(folder: Path, image_root: Path, certs: Certs, host: str, address: str) -> Path:
    """An overlay layer (top of the image's) in which the image trusts the test CA and `host` resolves to
    `address`."""
    bundle = folder / BUNDLE
    bundle.parent.mkdir(parents=True, exist_ok=True)
    bundle.write_bytes((image_root / BUNDLE).read_bytes() + certs.ca.read_bytes())
    (folder / "etc" / "hosts").write_text(f"127.0.0.1 localhost\n{address} {host}\n")
    return folder


def start(upstream: str, certs: Certs, address: str):
    """The Jobs proxy double on `address`:443 over TLS with the host's certificate; returns the server."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs.cert, certs.key)
    return jobs_proxy_double.start(upstream, address=(address, 443), tls=context)

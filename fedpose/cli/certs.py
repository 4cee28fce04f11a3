"""``fedpose certs``: development TLS material and SuperNode authentication keys.

Writes, into ``--out``:

- ``ca.crt`` / ``ca.key``            — a self-signed development CA (EC P-384);
- ``server.crt`` / ``server.key``    — the SuperLink certificate signed by that CA, with SANs for
  127.0.0.1, ::1, localhost and every ``--host`` given (a gRPC client checks the SAN, not the CN);
- ``sites/<site-id>`` / ``sites/<site-id>.pub`` — one ECDSA P-384 key pair per site in OpenSSH
  format: the private key is given to that site's SuperNode (``--auth-supernode-private-key``),
  the public key is registered with the SuperLink (``flwr supernode register``).

This is for development and the local demo. In production the server certificate comes from
the hospital's PKI and each site generates its own key pair and only hands over the ``.pub``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
from pathlib import Path

from fedpose.cli.common import UserError, print_json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "certs",
        help="create a development CA, SuperLink TLS certificate and per-site SuperNode auth keys",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument(
        "--sites", nargs="*", default=["site-0", "site-1", "site-2"], metavar="SITE_ID",
        help="site ids to create SuperNode auth keys for (default: site-0 site-1 site-2)",
    )
    parser.add_argument(
        "--host", action="append", default=[], metavar="NAME_OR_IP",
        help="extra SAN for the server certificate (repeatable), e.g. the coordinator's DNS name",
    )
    parser.add_argument("--days", type=int, default=365, help="certificate validity in days")
    parser.add_argument("--force", action="store_true", help="overwrite existing files")
    parser.set_defaults(handler=_handle)


def _handle(args: argparse.Namespace) -> int:
    out: Path = args.out
    if (out / "ca.crt").exists() and not args.force:
        raise UserError(f"{out / 'ca.crt'} already exists (use --force to overwrite)")
    if args.days < 1:
        raise UserError("--days must be ≥ 1")
    written = write_dev_certificates(out, site_ids=args.sites, extra_hosts=args.host, days=args.days)
    print_json({name: str(path) for name, path in written.items()})
    return 0


def write_dev_certificates(
    out: Path, site_ids: list[str], extra_hosts: list[str] | None = None, days: int = 365
) -> dict[str, Path]:
    """Create CA, server certificate and per-site auth keys in ``out``; return what was written."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from fedpose.io import atomic_write

    def write(path: Path, data: bytes, private: bool = False) -> Path:
        atomic_write(path, lambda fh: fh.write(data))
        path.chmod(0o600 if private else 0o644)  # mkstemp creates 0600; certificates are public
        return path

    def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    now = dt.datetime.now(dt.timezone.utc)
    not_before = now - dt.timedelta(minutes=5)  # tolerate small clock skew between machines
    not_after = now + dt.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedpose development CA")])
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
                digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )

    san: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1")),
    ]
    for host in extra_hosts or []:
        try:
            san.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            san.append(x509.DNSName(host))
    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedpose-superlink")]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    written = {
        "ca_cert": write(out / "ca.crt", ca_cert.public_bytes(serialization.Encoding.PEM)),
        "ca_key": write(out / "ca.key", pem_key(ca_key), private=True),
        "server_cert": write(out / "server.crt", server_cert.public_bytes(serialization.Encoding.PEM)),
        "server_key": write(out / "server.key", pem_key(server_key), private=True),
    }
    for site_id in site_ids:
        if not site_id or "/" in site_id or site_id.startswith("."):
            raise UserError(f"invalid site id {site_id!r}")
        site_key = ec.generate_private_key(ec.SECP384R1())
        private = site_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        )
        public = site_key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        written[f"{site_id}_key"] = write(out / "sites" / site_id, private, private=True)
        written[f"{site_id}_pub"] = write(out / "sites" / f"{site_id}.pub", public + b"\n")
    return written

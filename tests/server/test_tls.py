"""https on the server itself: the openai client trusting the test's CA gets answers; plain
http to the TLS port fails cleanly; with --ssl-ca-certs a client without a certificate is
refused and one with a certificate the CA signed is served."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from vivace.engine.async_engine import AsyncEngine
from vivace.server import ServerSettings

from .harness import RunningServer, serving


def _issue(subject: str, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None, *, ca: bool,
           server: bool = False) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    issuer_name, issuer_key = issuer or (name, key)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256()), key


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[str, str]:
    cert_file, key_file = path.with_suffix(".crt"), path.with_suffix(".key")
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, both signed by it."""
    out = tmp_path_factory.mktemp("pki")
    ca_cert, ca_key = _issue("vivace test CA", None, ca=True)
    server_cert, server_key = _issue("127.0.0.1", (ca_cert.subject, ca_key), ca=False, server=True)
    client_cert, client_key = _issue("client", (ca_cert.subject, ca_key), ca=False)
    return {"ca": _write(out / "ca", ca_cert, ca_key), "server": _write(out / "server", server_cert, server_key),
            "client": _write(out / "client", client_cert, client_key)}


@pytest.fixture(scope="module")
def tls_server(tiny_engine: AsyncEngine, pki) -> Iterator[RunningServer]:
    cert, key = pki["server"]
    with serving(tiny_engine, ServerSettings(served_model_name="tiny", ssl_certfile=cert, ssl_keyfile=key)) as s:
        yield s


def test_openai_client_over_https_trusting_the_ca(tls_server: RunningServer, pki):
    trust = ssl.create_default_context(cafile=pki["ca"][0])
    client = openai.OpenAI(base_url=f"{tls_server.base_url}/v1", api_key="none", max_retries=0,
                           http_client=httpx.Client(verify=trust))
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3)
    assert tls_server.base_url.startswith("https://") and reply.usage.completion_tokens >= 1


def test_plain_http_to_the_tls_port_fails_cleanly(tls_server: RunningServer, pki):
    plain = tls_server.base_url.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{plain}/health", timeout=10)
    untrusted = ssl.create_default_context()  # the system CAs do not know the test CA
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{tls_server.base_url}/health", verify=untrusted, timeout=10)
    assert httpx.get(f"{tls_server.base_url}/health", verify=ssl.create_default_context(
        cafile=pki["ca"][0]), timeout=10).status_code == 200  # and the server still serves


def test_client_certificates_required_with_ca_certs(tiny_engine: AsyncEngine, pki):
    cert, key = pki["server"]
    settings = ServerSettings(served_model_name="tiny", ssl_certfile=cert, ssl_keyfile=key,
                              ssl_ca_certs=pki["ca"][0])
    with serving(tiny_engine, settings) as server:
        anonymous = ssl.create_default_context(cafile=pki["ca"][0])
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{server.base_url}/health", verify=anonymous, timeout=10).raise_for_status()
        identified = ssl.create_default_context(cafile=pki["ca"][0])
        identified.load_cert_chain(*pki["client"])
        assert httpx.get(f"{server.base_url}/health", verify=identified, timeout=10).status_code == 200

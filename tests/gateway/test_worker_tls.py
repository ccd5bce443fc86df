"""`pdgate launch` in front of `https://` mock workers whose certificate a CA made in the test
signs: `--worker-ca-cert`, the worker key (`--worker-api-key` and PDGATE_WORKER_API_KEY) on
every call to a worker, and never the client's key."""

from __future__ import annotations

import datetime
import ipaddress
import pathlib
import ssl
import time

import httpx
import pytest

from tests.conftest import Processes
from tests.gateway.harness import launch
from tests.gateway.stacks import FAST_HEALTH, pd_stack
from tests.mock_workers import MockHost, MockWorker
from tests.mock_workers.model import expected_text

x509 = pytest.importorskip("cryptography.x509", reason="pip install cryptography (the test CA)")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

WORKER_KEY, CLIENT_KEY = "worker-secret-1", "client-secret-2"
PROMPT = "Once upon a time"


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca_and_server_cert(directory: pathlib.Path) -> tuple[pathlib.Path, ssl.SSLContext]:
    """A CA (its PEM written to `directory`) and a server context for 127.0.0.1 signed by it."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("pdgate test CA")).issuer_name(_name("pdgate test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(_name("127.0.0.1")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    ca_path, cert_path, key_path = directory / "ca.pem", directory / "worker.pem", directory / "worker.key"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_path, key_path)
    return ca_path, context


def test_https_worker_with_the_private_ca_and_the_worker_key_from_the_environment(
        tmp_path: pathlib.Path, mocks: MockHost, processes: Processes) -> None:
    ca, context = make_ca_and_server_cert(tmp_path)
    worker = mocks.start(MockWorker(ssl_context=context))
    assert worker.url.startswith("https://127.0.0.1:")
    gateway = launch(processes, ["--worker-urls", worker.url, "--worker-ca-cert", str(ca), "--api-key", CLIENT_KEY, *FAST_HEALTH],
                     env={"PDGATE_WORKER_API_KEY": WORKER_KEY})
    gateway.wait_ready()
    body = {"model": "mock-model", "prompt": PROMPT, "max_tokens": 4}
    r = httpx.post(gateway.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {CLIENT_KEY}"}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected_text("completions", body)[0]
    seen = mocks.state(worker)["authorizations"]
    paths = {path for path, _ in seen}
    assert {"/v1/completions", "/health", "/v1/models", "/server_info"} <= paths, paths
    assert {auth for _, auth in seen} == {f"Bearer {WORKER_KEY}"}, "every call carries the worker key, never the client's"


def test_pd_legs_over_tls_reach_both_workers(tmp_path: pathlib.Path, mocks: MockHost, processes: Processes) -> None:
    ca, context = make_ca_and_server_cert(tmp_path)
    tls = {"ssl_context": context}
    stack = pd_stack(mocks, processes, "bootstrap", prefill_knobs=tls, decode_knobs=tls,
                     args=["--worker-ca-cert", str(ca), "--worker-api-key", WORKER_KEY])
    body = {"model": "mock-model", "prompt": PROMPT, "max_tokens": 3}
    r = httpx.post(stack.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {CLIENT_KEY}"}, timeout=10)
    assert r.status_code == 200, r.text
    for worker in (stack.prefill, stack.decode):
        assert worker.url.startswith("https://")
        state = mocks.state(worker)
        assert [rec["path"] for rec in state["received"]] == ["/v1/completions"]
        assert not state["violations"], state["violations"]
        assert {auth for _, auth in state["authorizations"]} == {f"Bearer {WORKER_KEY}"}


def test_without_the_ca_the_worker_is_refused_with_a_tls_reason(
        tmp_path: pathlib.Path, mocks: MockHost, processes: Processes) -> None:
    _, context = make_ca_and_server_cert(tmp_path)
    worker = mocks.start(MockWorker(ssl_context=context))
    gateway = launch(processes, ["--worker-urls", worker.url, *FAST_HEALTH])
    r = httpx.post(gateway.url + "/v1/completions", json={"prompt": PROMPT}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_available_workers", r.text
    assert mocks.state(worker)["received"] == [], "no request crosses a refused handshake"
    # The health checks' failures say why, with the worker's URL (logged once per check).
    lines = wait_for_lines(gateway.output, "TLS handshake")
    assert lines and worker.url in lines[0] and "certificate" in lines[0], "".join(gateway.output)


def wait_for_lines(output: list[str], needle: str, timeout: float = 10.0) -> list[str]:
    """The output lines containing `needle`, waiting up to `timeout` for the first one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [line for line in list(output) if needle in line]
        if found:
            return found
        time.sleep(0.05)
    return []

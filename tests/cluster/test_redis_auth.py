"""A cluster whose Redis wants a password, or TLS: everything about the connection is in the URL.

With `redis://:PASSWORD@...` every role authenticates and a completion goes through end to end;
the password shows up in no role's log. A wrong or missing password stops `nori serve` with a
one-line error that names Redis and the credentials, hides the password, and is no traceback;
so does a URL redis-py cannot use (TLS arguments on redis://).
With `rediss://...?ssl_ca_certs=...` (mutual TLS against a throwaway CA, and a password) the
cluster serves as well; where redis-server was built without TLS, that test is skipped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, urlencode

import httpx
import pytest

from nori.launch.local_cluster import LocalCluster, free_port
from nori.launch.redis_server import RedisServer, find_redis_server, redis_reachable
from nori.state.connection import connect, redacted
from tests.cluster.conftest import start_cluster

pytestmark = pytest.mark.slow

# Characters a URL must escape (/ @ :): every role must unquote it from the URL to log in.
PASSWORD = "s3cret/p@ss:word"
QUOTED_PASSWORD = quote(PASSWORD, safe="")


def _complete(cluster: LocalCluster) -> httpx.Response:
    return httpx.post(
        f"{cluster.url}/v1/completions",
        json={"prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True},
        timeout=60,
    )


def _serves_a_completion(redis_url: str, checkpoint: Path, logs: Path) -> None:
    cluster = start_cluster(redis_url, checkpoint, logs, num_prefill=1, num_decode=1)
    try:
        response = _complete(cluster)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
    finally:
        cluster.stop()
    for log in logs.glob("*.log"):
        text = log.read_text(errors="replace")
        assert PASSWORD not in text and QUOTED_PASSWORD not in text, log


@pytest.fixture
def password_redis() -> Iterator[RedisServer]:
    server = RedisServer(password=PASSWORD)
    try:
        server.start()
    except Exception as error:
        pytest.skip(f"no redis-server for this test: {error}")
    yield server
    server.stop()


def test_a_cluster_authenticates_with_the_password_in_the_url(
    password_redis: RedisServer, checkpoint: Path, tmp_path: Path
) -> None:
    assert f":{QUOTED_PASSWORD}@" in password_redis.url
    _serves_a_completion(password_redis.url, checkpoint, tmp_path)


@pytest.mark.parametrize("role", ["gateway", "prefill"])
@pytest.mark.parametrize("credentials", ["wrong", "none"])
def test_bad_credentials_stop_a_role_with_a_one_line_error(
    password_redis: RedisServer, checkpoint: Path, role: str, credentials: str
) -> None:
    given = ":wrong-password@" if credentials == "wrong" else ""
    url = password_redis.url.replace(f":{QUOTED_PASSWORD}@", given)
    port = str(free_port()) if role == "gateway" else "0"
    command = [sys.executable, "-m", "nori.cli.main", "serve", role, "--model", str(checkpoint)]
    finished = subprocess.run(
        [*command, "--port", port],
        env={**os.environ, "REDIS_URL": url},
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = finished.stdout + finished.stderr
    assert finished.returncode == 2, output
    assert "nori: error: Redis at redis://" in output, output
    assert "refused the credentials" in output, output
    assert "Traceback" not in output, output
    assert "wrong-password" not in output, output


def test_a_url_redis_py_cannot_use_is_a_clear_error_that_hides_the_password() -> None:
    url = f"redis://:{QUOTED_PASSWORD}@127.0.0.1:6379/0?ssl_ca_certs=/ca.crt"
    with pytest.raises(ValueError, match=r"TLS arguments \(ssl_\*\) need rediss://") as raised:
        connect(url)
    assert "redis://:***@127.0.0.1:6379/0?ssl_ca_certs=/ca.crt" in str(raised.value)
    assert redacted("rediss://h:1/0?password=secret&db=2") == "rediss://h:1/0?password=***&db=2"


# ----------------------------------------------------------------------------- TLS


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _issue(name: str, extensions: str, cwd: Path) -> None:
    """A key and a certificate for `name`, signed by the throwaway CA in `cwd`."""
    (cwd / f"{name}.ext").write_text(extensions)
    key_args = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", *key_args, "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN=nori-test-{name}", cwd=cwd)  # fmt: skip
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "1", "-out", f"{name}.crt",
             "-extfile", f"{name}.ext", cwd=cwd)  # fmt: skip


def _throwaway_pki(folder: Path) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, valid for a day."""
    folder.mkdir()
    key_args = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *key_args, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
             "-subj", "/CN=nori-test-ca",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=folder)  # fmt: skip
    # Key identifiers and key usage too: Python 3.13 verifies strictly (VERIFY_X509_STRICT).
    common = (
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
    )
    _issue("server", f"{common}subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n", folder)
    _issue("client", f"{common}extendedKeyUsage=clientAuth\n", folder)
    return folder


@pytest.fixture
def tls_redis_url(tmp_path: Path) -> Iterator[str]:
    """A redis-server on TLS only (client certificates required, and the password), as a
    rediss:// URL whose query holds the certificates, as redis-py's from_url reads them."""
    binary = find_redis_server()
    if binary is None or shutil.which("openssl") is None:
        pytest.skip("needs redis-server and the openssl command")
    pki = _throwaway_pki(tmp_path / "pki")
    port = free_port()
    command = [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
               "--tls-cert-file", str(pki / "server.crt"), "--tls-key-file", str(pki / "server.key"),
               "--tls-ca-cert-file", str(pki / "ca.crt"), "--requirepass", PASSWORD,
               "--save", "", "--appendonly", "no", "--dir", str(tmp_path)]  # fmt: skip
    log_path = tmp_path / "redis-tls.log"
    with log_path.open("wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    query = urlencode(
        {
            "ssl_cert_reqs": "required",
            "ssl_ca_certs": pki / "ca.crt",
            "ssl_certfile": pki / "client.crt",
            "ssl_keyfile": pki / "client.key",
        }
    )
    url = f"rediss://:{QUOTED_PASSWORD}@127.0.0.1:{port}/0?{query}"
    try:
        deadline = time.monotonic() + 10
        while not redis_reachable(url):
            if server.poll() is not None:
                output = log_path.read_text(errors="replace")
                if "tls-port" in output and "Bad directive" in output:
                    pytest.skip(f"{binary} was built without TLS")
                pytest.fail(f"redis-server with TLS exited: {output}")
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")
            time.sleep(0.05)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_a_cluster_connects_over_tls_with_the_certificates_in_the_url(
    tls_redis_url: str, checkpoint: Path, tmp_path: Path
) -> None:
    # The plain protocol on the TLS port gets nowhere: the cluster below really speaks TLS.
    plain = tls_redis_url.partition("?")[0].replace("rediss://", "redis://", 1)
    assert not redis_reachable(plain)
    _serves_a_completion(tls_redis_url, checkpoint, tmp_path / "logs")

"""API keys and tenants without Ray: the keys file, who a key identifies, the guard's exact
answers, and what a tenant's request carries to the replicas."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from radixserve.cluster.config import ServerArgs, parse_cli
from radixserve.router.frontend.api import Guard, add_error_handlers
from radixserve.router.frontend.serving import _requests
from radixserve.router.frontend.tenants import (
    OPEN,
    ApiKeys,
    ApiKeysError,
    Identity,
    identity_of,
    load_api_keys,
)
from radixserve.workers.protocol import SamplingParams

KEYS = "acme: sk-acme-1\nglobex: [sk-globex-1, sk-globex-2]\n"


def write(tmp_path, text: str, name: str = "keys.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_keys_file_forms(tmp_path):
    expected = {"acme": ("sk-acme-1",), "globex": ("sk-globex-1", "sk-globex-2")}
    assert load_api_keys(write(tmp_path, KEYS)) == expected
    as_json = '{"acme": "sk-acme-1", "globex": ["sk-globex-1", "sk-globex-2"]}'
    assert load_api_keys(write(tmp_path, as_json, "keys.json")) == expected
    lines = "# tenant: key\nacme: sk-acme-1\nglobex: sk-globex-1\n"
    assert load_api_keys(write(tmp_path, lines, "keys.txt")) == {
        "acme": ("sk-acme-1",),
        "globex": ("sk-globex-1",),
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "expected a non-empty mapping of tenant name to key or list of keys"),
        ("- sk-1\n", "expected a non-empty mapping of tenant name to key or list of keys"),
        ("acme: [sk-1\n", "not valid YAML or JSON at line 2"),
        ("a/b: sk-secret-1\n", "tenant name 'a/b' must be 1-64 letters, digits, '_', '.' or '-'"),
        ("acme: []\n", "tenant 'acme': expected a key or a non-empty list of keys"),
        ("acme: 12345678\n", "tenant 'acme', key #1: keys are strings of printable ASCII without spaces"),
        ("acme: [sk-ok-1, 'sk secret']\n", "tenant 'acme', key #2: keys are strings of printable ASCII"),
        (
            "acme: sk-secret-1\nglobex: [sk-2, sk-secret-1]\n",
            "tenant 'globex', key #2: already a key of 'acme'",
        ),
        ("acme: sk-1\nglobex: sk-2\nacme: sk-3\n", "'acme' appears twice in one mapping (line 3)"),
    ],
)
def test_bad_keys_files_are_clear_errors_that_never_show_a_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ApiKeysError) as e:
        load_api_keys(path)
    assert str(e.value).startswith(f"api_keys_file {path}: {message}")
    assert "secret" not in str(e.value)


def test_bad_key_settings_stop_the_server_before_it_starts(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ValueError, match=f"api_keys_file {missing}: cannot read it"):
        ServerArgs.from_dict({"api_keys_file": missing})
    path = write(tmp_path, KEYS)
    with pytest.raises(ValueError, match="give api_key .* or api_keys_file .*, not both"):
        ServerArgs.from_dict({"api_keys_file": path, "api_key": "k"})
    with pytest.raises(ValueError, match="admin_api_key must differ from the other keys"):
        ServerArgs.from_dict({"api_keys_file": path, "admin_api_key": "sk-globex-2"})
    with pytest.raises(SystemExit):
        parse_cli(["--api-keys-file", write(tmp_path, "acme: []\n", "bad.yaml")])
    args = parse_cli(["--api-keys-file", path, "--admin-api-key", "sk-admin"])
    assert (args.http.api_keys_file, args.http.admin_api_key) == (path, "sk-admin")


def bearer(key: str) -> bytes:
    return f"Bearer {key}".encode()


def test_who_a_key_identifies(tmp_path):
    tenants = ApiKeys.from_settings(api_keys_file=write(tmp_path, KEYS), admin_api_key="sk-admin")
    assert tenants.identify(bearer("sk-acme-1")) == Identity("acme", admin=False)
    assert tenants.identify(bearer("sk-globex-2")) == Identity("globex", admin=False)
    assert tenants.identify(bearer("sk-admin")) == Identity(None, admin=True)
    for wrong in (bearer("sk-acme-"), bearer(""), b"sk-acme-1", b"", b"Basic sk-acme-1"):
        assert tenants.identify(wrong) is None
    assert tenants.identify(b"bearer  sk-acme-1 ") == Identity("acme", admin=False)
    # One key: the shared tenant, admin unless an admin key is set. No key: everyone is OPEN.
    assert ApiKeys.from_settings("k").identify(bearer("k")) == Identity(None, admin=True)
    single = ApiKeys.from_settings("k", admin_api_key="sk-admin")
    assert single.identify(bearer("k")) == Identity(None, admin=False)
    assert single.identify(bearer("sk-admin")) == Identity(None, admin=True)
    assert ApiKeys.from_settings().identify(b"") == OPEN
    assert ApiKeys.from_settings("").identify(b"") == OPEN  # an empty key is no key
    assert not ApiKeys.from_settings().required and single.required


def test_a_tenant_s_requests_carry_its_namespace_and_qualified_ids():
    acme = Identity("acme", admin=False)
    (one,) = _requests([[1, 2]], [SamplingParams()], "r1", False, acme)
    assert (one.rid, one.namespace, one.input_ids) == ("acme/r1", "acme", [1, 2])
    two = _requests([[1], [2]], [SamplingParams()] * 2, "r2", True, acme)
    assert [(r.rid, r.namespace) for r in two] == [("acme/r2\x1fp0", "acme"), ("acme/r2\x1fp1", "acme")]
    (shared,) = _requests([[1]], [SamplingParams()], "r1", False, OPEN)
    assert (shared.rid, shared.namespace) == ("r1", None)


def guarded_app(keys: ApiKeys) -> TestClient:
    app = FastAPI()
    app.add_middleware(Guard, keys=keys, max_bytes=1024)
    add_error_handlers(app)

    async def whoami(request: Request) -> dict:
        who = identity_of(request)
        return {"tenant": who.tenant, "admin": who.admin}

    for path in ("/whoami", "/flush_cache", "/health"):
        app.add_api_route(path, whoami, methods=["GET"])
    return TestClient(app)


def test_guard_answers_exactly(tmp_path):
    client = guarded_app(ApiKeys.from_settings(api_keys_file=write(tmp_path, KEYS), admin_api_key="sk-admin"))
    acme = {"Authorization": "Bearer sk-acme-1"}
    assert client.get("/whoami", headers=acme).json() == {"tenant": "acme", "admin": False}
    r = client.get("/flush_cache", headers=acme)
    assert r.status_code == 403
    assert r.json() == {
        "error": {
            "message": "This endpoint needs the admin API key.",
            "type": "invalid_request_error",
            "param": None,
            "code": "admin_key_required",
        }
    }
    admin = {"Authorization": "Bearer sk-admin"}
    assert client.get("/flush_cache", headers=admin).json() == {"tenant": None, "admin": True}
    r = client.get("/whoami", headers={"Authorization": "Bearer sk-nobody"})
    assert (r.status_code, r.json()["error"]["code"]) == (401, "invalid_api_key")
    assert client.get("/flush_cache").status_code == 401  # no key: 401 before 403
    # /health needs no key; no identity is set there, and the fallback has no admin rights.
    assert client.get("/health").json() == {"tenant": None, "admin": False}


def test_guard_single_key_and_open_modes_are_unchanged():
    single = guarded_app(ApiKeys.from_settings("k"))
    assert single.get("/flush_cache", headers={"Authorization": "Bearer k"}).json() == {
        "tenant": None,
        "admin": True,
    }
    assert single.get("/whoami").status_code == 401
    open_app = guarded_app(ApiKeys.from_settings())
    assert open_app.get("/flush_cache").json() == {"tenant": None, "admin": True}

"""API keys and tenants: who sent a request, and what that caller may do.

Three set-ups:
- no key: every caller is the shared tenant, with admin rights (a private server);
- `api_key`: one key for one shared tenant. Its holder has admin rights, unless `admin_api_key`
  is set too, which then alone opens the admin routes;
- `api_keys_file`: several tenants, each with its own keys, and `admin_api_key` (if set) for
  the admin routes. Each tenant's prompts are cached and routed in its own namespace, so no
  tenant can learn another's prompts from `cached_tokens`, latency or routing; each tenant's
  request ids live in its own space, so no tenant can collide with or abort another's request.

The keys file is a YAML (or JSON) mapping of tenant name to one key or a list of keys; the plain
`tenant: key` lines of a text file are such a mapping already:

    acme: sk-acme-1
    globex: [sk-globex-1, sk-globex-2]

Tenant names are 1-64 letters, digits, '_', '.', '-' (no '/': a tenant's request ids reach the
replicas as `<tenant>/<rid>`). Keys are printable ASCII without spaces, each used once.

The shared tenant and the admin key work in namespace None, with request ids as sent; so the
admin aborts a tenant's request by its qualified id, `<tenant>/<rid>`.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from typing import Any

import yaml

ADMIN_ROUTES = frozenset({"/flush_cache", "/load_lora_adapter", "/unload_lora_adapter"})
IDENTITY = "identity"  # the key of the caller's Identity in the ASGI scope's state
SECRET_SETTINGS = ("api_key", "admin_api_key", "api_keys_file")  # shown masked in server info
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_KEY = re.compile(r"[\x21-\x7e]+")


class ApiKeysError(ValueError):
    """A key setting or keys file that cannot be used; the message names the problem (never a
    key)."""


@dataclass(frozen=True)
class Identity:
    tenant: str | None  # None: the shared tenant (and the admin)
    admin: bool

    @property
    def namespace(self) -> str | None:
        """The cache namespace of this caller's requests."""
        return self.tenant

    def engine_rid(self, rid: str) -> str:
        """The request id the replicas see for this caller's `rid`."""
        return rid if self.tenant is None else f"{self.tenant}/{rid}"


OPEN = Identity(None, admin=True)  # no key configured: anyone may do anything
SHARED = Identity(None, admin=False)


def identity_of(request: Any) -> Identity:
    """The caller of an HTTP request (anything with an ASGI `scope`), as the API's guard put it
    in the scope's state; SHARED, without admin rights, where no guard ran."""
    return request.scope.get("state", {}).get(IDENTITY, SHARED)


class ApiKeys:
    """The key table. `identify` compares a presented key with every key (SHA-256 digests,
    constant-time), so neither timing nor length tells which key, if any, came close."""

    def __init__(self, keys: dict[str, Identity]):
        self._table = [(_digest(k), who) for k, who in keys.items()]

    @classmethod
    def from_settings(
        cls, api_key: str | None = None, api_keys_file: str | None = None, admin_api_key: str | None = None
    ) -> ApiKeys:
        """The table for these settings; raises ApiKeysError (a ValueError) on bad ones. An
        empty key is no key, as it has always been for `api_key`."""
        api_key, admin_api_key, api_keys_file = api_key or None, admin_api_key or None, api_keys_file or None
        if admin_api_key is not None and not _KEY.fullmatch(admin_api_key):
            raise ApiKeysError("admin_api_key must be printable ASCII without spaces")
        if api_key is not None and api_keys_file is not None:
            raise ApiKeysError("give api_key (one shared tenant) or api_keys_file (tenants), not both")
        keys: dict[str, Identity] = {}
        if api_keys_file is not None:
            for tenant, tenant_keys in load_api_keys(api_keys_file).items():
                keys.update(dict.fromkeys(tenant_keys, Identity(tenant, admin=False)))
        elif api_key is not None:
            keys[api_key] = Identity(None, admin=admin_api_key is None)
        if admin_api_key is not None:
            if admin_api_key in keys:
                raise ApiKeysError("admin_api_key must differ from the other keys")
            keys[admin_api_key] = Identity(None, admin=True)
        return cls(keys)

    @property
    def required(self) -> bool:
        return bool(self._table)

    def identify(self, authorization: bytes) -> Identity | None:
        """The caller of an `Authorization` header value; None for a missing or wrong key.
        Without any key configured, everyone is OPEN."""
        if not self._table:
            return OPEN
        token = authorization[7:].strip() if authorization[:7].lower() == b"bearer " else b""
        presented = _digest(token)
        found = None
        for digest, who in self._table:  # no early exit: the time does not depend on the match
            if hmac.compare_digest(presented, digest):
                found = who
        return found


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping naming one key twice (PyYAML keeps the last)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise ApiKeysError(f"{key!r} appears twice in one mapping (line {key_node.start_mark.line + 1})")
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def load_api_keys(path: str) -> dict[str, tuple[str, ...]]:
    """Tenant name -> its keys, read from `path`; ApiKeysError (naming the file and the
    problem, never a key) when it cannot be used."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_UniqueKeyLoader)  # a SafeLoader: plain data only
    except OSError as e:
        raise ApiKeysError(f"api_keys_file {path}: cannot read it ({e.strerror})") from None
    except ApiKeysError as e:
        raise ApiKeysError(f"api_keys_file {path}: {e}") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise ApiKeysError(f"api_keys_file {path}: not valid YAML or JSON{line}") from None
    try:
        return _validate(data)
    except ApiKeysError as e:
        raise ApiKeysError(f"api_keys_file {path}: {e}") from None


def _validate(data: Any) -> dict[str, tuple[str, ...]]:
    if not isinstance(data, dict) or not data:
        raise ApiKeysError("expected a non-empty mapping of tenant name to key or list of keys")
    owner: dict[str, str] = {}
    tenants: dict[str, tuple[str, ...]] = {}
    for tenant, keys in data.items():
        if not isinstance(tenant, str) or not _TENANT_NAME.fullmatch(tenant):
            raise ApiKeysError(
                f"tenant name {tenant!r} must be 1-64 letters, digits, '_', '.' or '-', starting "
                "with a letter or digit"
            )
        keys = keys if isinstance(keys, list) else [keys]
        if not keys:
            raise ApiKeysError(f"tenant {tenant!r}: expected a key or a non-empty list of keys")
        for i, key in enumerate(keys):
            if not isinstance(key, str) or not _KEY.fullmatch(key):
                raise ApiKeysError(
                    f"tenant {tenant!r}, key #{i + 1}: keys are strings of printable ASCII without "
                    "spaces (quote a key that YAML would read as a number)"
                )
            if key in owner:
                raise ApiKeysError(f"tenant {tenant!r}, key #{i + 1}: already a key of {owner[key]!r}")
            owner[key] = tenant
        tenants[tenant] = tuple(keys)
    return tenants

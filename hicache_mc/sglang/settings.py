"""Settings of the SGLang backend, read from ``storage_config.extra_config``.

One extra-config dict carries three kinds of key:

- the factory's and HiCache's own keys (ignored here; HiCache pops most of its keys before the
  backend sees them, but a config built by hand may still hold them);
- every ``ClientConfig`` field (``master``, ``transport``, ``timeout_s``, ...), plus
  ``config_file``: a TOML/JSON file whose ``[client]`` table feeds the same loader;
- the adapter's own ``AdapterSettings`` fields (``tenant``, ...).

Anything else is a ``ConfigError`` that names the key, so a typo fails SGLang at start-up instead
of silently running with defaults. Precedence follows the project loader: defaults < file <
``HICACHE_MC_*`` environment < extra config.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ..auth import tenant_for
from ..config import ClientConfig, load_config
from ..errors import ConfigError
from ..keys import KVNamespace

# Read by SGLang's StorageBackendFactory / HiCacheController, never by us.
FACTORY_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
HICACHE_KEYS = frozenset({
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "prefetch_timeout_max", "hicache_storage_pass_prefix_keys", "tp_lcm_size",
})


@dataclass(frozen=True)
class AdapterSettings:
    """What the SGLang backend adds to a StoreClient's settings."""
    tenant: str = ""           # isolates deployments that share a store and a model (a client
                               # credential's tenant when the token is one)
    model_name: str = ""       # overrides --served-model-name in the key namespace
    kv_cache_dtype: str = ""   # the --kv-cache-dtype; tells fp8 variants apart (host pools hold them as uint8)
    # pages, from a chain's first, written with the client's `replicas` copies (needs SGLang's
    # prefix keys, hicache_storage_pass_prefix_keys); -1: every page (a namespace every
    # instance reads); 0: none
    hot_pages: int = 0

    def __post_init__(self):
        if self.hot_pages < -1:
            raise ConfigError(f"hot_pages: expected -1, 0 or a page count, got {self.hot_pages}")


def load_settings(extra: Optional[Mapping[str, Any]],
                  env: Optional[Mapping[str, str]] = None) -> tuple[ClientConfig, AdapterSettings]:
    """Split ``extra`` into a ClientConfig and AdapterSettings; raise ConfigError on unknown keys."""
    extra = dict(extra or {})
    client_fields = {f.name for f in dataclasses.fields(ClientConfig)}
    adapter_fields = {f.name for f in dataclasses.fields(AdapterSettings)}
    known = client_fields | adapter_fields | FACTORY_KEYS | HICACHE_KEYS | {"config_file"}
    unknown = sorted(k for k in extra if k not in known)
    if unknown:
        raise ConfigError(f"{', '.join(unknown)}: unknown hicache_mc setting(s) in "
                          f"--hicache-storage-backend-extra-config (known: "
                          f"{', '.join(sorted(client_fields | adapter_fields | {'config_file'}))})")
    config_file = extra.get("config_file") or None
    client = load_config(ClientConfig, file=config_file, env=env, section="client",
                         **{k: v for k, v in extra.items() if k in client_fields})
    adapter = load_config(AdapterSettings, env=env,
                          **{k: v for k, v in extra.items() if k in adapter_fields})
    try:   # the key module owns the tenant rules; a client credential names the tenant
        adapter = dataclasses.replace(adapter, tenant=tenant_for(client.token, adapter.tenant))
        KVNamespace(model="", kv_dtype="", layout="", page_size=1, tenant=adapter.tenant).digest()
    except ValueError as exc:
        raise ConfigError(f"tenant: {exc}") from None
    return client, adapter

"""The Snakemake S3 plugin rides out storage outages as the jobs' storage layer does.

The plugin's boto client retries ``storage-s3-retries`` times with botocore's backoff (capped at
20 s a try): 15 retries gave up after about two minutes of outage, and a run of days ended with
it. ``ride_out_plugin_outages`` puts ``dflash_pipeline.core.outage``'s handler first on the
client of every S3 provider, those the registry already holds (the default storage provider is
made before the Snakefile is read) and any made later, so the driver's existence checks, the
uploads of declared outputs and logs, and the jobs' own Snakemake processes retry up to
``storage.outage_tolerance_s`` too. The wrapper relies only on the provider's ``s3c`` resource,
which the provider's ``__post_init__`` makes: guarded by that function's fingerprint
(``dflash_pipeline.snakemake_patches``), off with one warning where it changed.
"""

from __future__ import annotations

from dflash_pipeline.core import outage
from dflash_pipeline.snakemake_patches import Patch, install

PLUGIN = "snakemake_storage_plugin_s3"
_MARK = "_dflash_rides_out_outages"


def _install_on(provider) -> bool:
    resource = getattr(provider, "s3c", None)
    client = getattr(getattr(resource, "meta", None), "client", None)
    if client is None:
        return False
    outage.install(client)
    return True


def _apply() -> None:
    import snakemake_storage_plugin_s3 as plugin

    original = plugin.StorageProvider.__post_init__

    def __post_init__(self):
        original(self)
        _install_on(self)

    __post_init__.__wrapped__ = original
    plugin.StorageProvider.__post_init__ = __post_init__


PATCHES = [
    Patch(
        "S3 plugin rides out storage outages",
        {f"{PLUGIN}:StorageProvider.__post_init__": "7a409f406b107076"},
        _apply,
    )
]


def ride_out_plugin_outages(registry=None) -> int:
    """Install the outage handler on the S3 plugin's providers (``registry``: Snakemake's
    storage registry, whose providers exist already) and on every one made later (idempotent).
    How many existing providers got it; 0 without the plugin or where its guard is off."""
    try:
        import snakemake_storage_plugin_s3 as plugin
    except ImportError:
        return 0
    provider_class = plugin.StorageProvider
    if not hasattr(provider_class, _MARK):
        what_happens = "the S3 plugin gives up after its own retries (about two minutes of outage)"
        setattr(provider_class, _MARK, install(PATCHES, what_happens))
    if not getattr(provider_class, _MARK):
        return 0
    providers = getattr(registry, "_storages", None) or {}
    return sum(_install_on(p) for p in providers.values() if isinstance(p, provider_class))

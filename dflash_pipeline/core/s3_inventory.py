"""Planning against S3 from folder listings: absence is read from the listing, not asked per object.

Snakemake plans a run by asking, for every input and output, whether it exists and when it was
written. The S3 storage plugin (snakemake-storage-plugin-s3 0.3.6) answers from one listing of the
folder of the first object it is asked about, but records the bucket, not that folder, as listed,
and Snakemake's cache only trusts an absence when the object's "inventory parent" is marked as
completely listed. So every object missing from the listing costs three more requests
(HeadObject, then HeadBucket and a ListObjects to see whether it is a directory): measured at
10,000 shards, an interrupted run with 12.5k objects missing took 37.6k requests.

``install_folder_inventory`` changes two methods of the plugin's storage object, in the process
that plans the run (the Snakefile calls it): the inventory parent of an object is its folder, and
the inventory lists that folder's direct children (paginated ListObjectsV2 with a "/" delimiter:
subfolders such as ``_progress/`` are not walked) and marks the folder as completely listed. An
object absent from its folder's listing is then known to be absent with no request; each folder
is listed once. Snakemake trusts the cache only while it plans (it clears and deactivates it
before any job runs), so objects written during the run are always asked for afresh.

It is a patch of two methods rather than a storage plugin of its own because a separate plugin
would have its own name, so its own ``SNAKEMAKE_STORAGE_<NAME>_*`` settings and profile keys,
while the plugin's settings are the single source of truth of the pipeline's storage layer too.
It applies only to the pinned plugin version, whose internals it relies on; with any other
version it does nothing and says so once. ``DFLASH_S3_FOLDER_INVENTORY=0`` turns it off.

``DFLASH_S3_REQUEST_LOG=<path>``: the process counts the S3 requests of the plugin by operation
and writes them there as JSON when it exits (the dry-run benchmark and its test read them).
"""

from __future__ import annotations

import atexit
import importlib.metadata
import json
import logging
import os
import posixpath
from collections import Counter

log = logging.getLogger(__name__)

PLUGIN_DIST = "snakemake-storage-plugin-s3"
# The plugin version whose StorageObject internals (key, bucket, _local_suffix_from_key,
# provider.s3c, bucket_exists) these methods use.
PLUGIN_VERSION = "0.3.6"
DISABLE_ENV = "DFLASH_S3_FOLDER_INVENTORY"
REQUEST_LOG_ENV = "DFLASH_S3_REQUEST_LOG"

_MARK = "_dflash_folder_inventory"


def folder_prefix(key: str) -> str:
    """The listing prefix of the folder holding ``key``: ``a/b/c`` -> ``a/b/``, ``c`` -> ``""``."""
    folder = posixpath.dirname(key)
    return f"{folder}/" if folder else ""


def _folder_parent(self) -> str:
    return self.cache_key(self._local_suffix_from_key(posixpath.dirname(self.key)))


async def _folder_inventory(self, cache) -> None:
    from snakemake_interface_storage_plugins.io import Mtime

    parent = self.get_inventory_parent()
    listed = getattr(cache.exists_in_storage, "has_inventory", None)
    if listed is not None and parent in listed:
        return
    if not self.bucket_exists():
        cache.exists_in_storage[self.cache_key()] = False
        return
    client = self.provider.s3c.meta.client
    pages = client.get_paginator("list_objects_v2").paginate(
        Bucket=self.bucket, Prefix=folder_prefix(self.key), Delimiter="/"
    )
    for page in pages:
        for item in page.get("Contents", ()):
            if item["Key"].endswith("/"):
                continue  # a folder marker object, not a file
            key = self.cache_key(self._local_suffix_from_key(item["Key"]))
            cache.mtime[key] = Mtime(storage=item["LastModified"].timestamp())
            cache.size[key] = item["Size"]
            cache.exists_in_storage[key] = True
        for sub in page.get("CommonPrefixes", ()):
            # A subfolder exists (a directory output); its files are listed when asked for.
            folder = sub["Prefix"].rstrip("/")
            cache.exists_in_storage[self.cache_key(self._local_suffix_from_key(folder))] = True
    if listed is not None:
        listed.add(parent)


def count_requests(path: str) -> None:
    """Count every S3 request this process makes (any boto3 client: the plugin's and the
    storage layer's) by operation, and write the counts to ``path`` as JSON at exit (added to
    what is there already). Idempotent."""
    import botocore.client

    client = botocore.client.BaseClient
    if getattr(client, _MARK, False):
        return
    counts: Counter = Counter()
    call = client._make_api_call

    def counted(self, operation_name, api_params):
        counts[operation_name] += 1
        return call(self, operation_name, api_params)

    client._make_api_call = counted
    setattr(client, _MARK, True)

    def write() -> None:
        previous = json.loads(open(path).read()) if os.path.exists(path) else {}
        total = Counter(previous) + counts
        with open(path, "w") as out:
            json.dump(dict(sorted(total.items())), out)

    atexit.register(write)


def install_folder_inventory() -> bool:
    """Patch the S3 plugin's inventory to list folders (see the module docstring); True when it
    is in place. Idempotent; a no-op without the plugin, with another plugin version or with
    ``DFLASH_S3_FOLDER_INVENTORY=0``."""
    if os.environ.get(REQUEST_LOG_ENV):
        count_requests(os.environ[REQUEST_LOG_ENV])
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return False
    try:
        version = importlib.metadata.version(PLUGIN_DIST)
        import snakemake_storage_plugin_s3 as plugin
    except (importlib.metadata.PackageNotFoundError, ImportError):
        return False
    if version != PLUGIN_VERSION:
        log.warning(
            "%s %s is not %s: planning asks S3 about every missing object (3 requests each)",
            PLUGIN_DIST, version, PLUGIN_VERSION,
        )
        return False
    objects = plugin.StorageObject
    if not getattr(objects, _MARK, False):
        objects.get_inventory_parent = _folder_parent
        objects.inventory = _folder_inventory
        setattr(objects, _MARK, True)
    return True

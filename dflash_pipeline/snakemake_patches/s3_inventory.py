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

Planning cost per object. At 10,000 shards a plan handles ~70,000 objects, and the plugin's
objects were the larger part of what planning against S3 cost beyond planning on local files
(2,000 shards on a loaded 2-core machine: 10.6 s of CPU against 5.3 s): each object parses its URL
anew (``__post_init__``), builds ``pathlib`` paths for every cache lookup (``cache_key``,
``local_path``), and botocore parses every listed timestamp with dateutil. The same patch
memoizes those, each object's folder (its inventory parent, asked for ~4 times per object) and
the provider's query check (pure functions of the query, or of the local prefix and suffix),
splits plain ``s3://bucket/key`` queries without ``urlparse`` (and accepts them as valid without
it), and parses S3's ISO 8601 timestamps with ``datetime.fromisoformat``, falling back to
botocore's parser for any other form; ``bench/dryrun_s3.py`` records the effect.

It is a patch of a few methods rather than a storage plugin of its own because a separate plugin
would have its own name, so its own ``SNAKEMAKE_STORAGE_<NAME>_*`` settings and profile keys,
while the plugin's settings are the single source of truth of the pipeline's storage layer too.
Each change is guarded by the fingerprints of the functions it replaces or relies on (the
plugin's, the storage interface's, and Snakemake's ``ExistsDict``, which trusts an absence only
under a listed parent; ``dflash_pipeline.snakemake_patches``): one whose function changed is left
out with a warning. ``DFLASH_S3_FOLDER_INVENTORY=0`` turns them all off.

``DFLASH_S3_REQUEST_LOG=<path>``: the process counts the S3 requests of the plugin by operation
and writes them there as JSON when it exits (the dry-run benchmark and its test read them).
"""

from __future__ import annotations

import atexit
import datetime
import functools
import json
import os
import posixpath
import re
from collections import Counter

from dflash_pipeline.snakemake_patches import Patch, install

PLUGIN = "snakemake_storage_plugin_s3"
DISABLE_ENV = "DFLASH_S3_FOLDER_INVENTORY"
REQUEST_LOG_ENV = "DFLASH_S3_REQUEST_LOG"

_MARK = "_dflash_folder_inventory"


def folder_prefix(key: str) -> str:
    """The listing prefix of the folder holding ``key``: ``a/b/c`` -> ``a/b/``, ``c`` -> ``""``."""
    folder = posixpath.dirname(key)
    return f"{folder}/" if folder else ""


def _folder_parent(self) -> str:
    return self.cache_key(self._local_suffix_from_key(_folder_of(self.key)))


# Pure functions of their arguments, memoized for the process that plans (module docstring).
_folder_of = functools.cache(posixpath.dirname)


@functools.cache
def _under(local_prefix, local_suffix: str):
    """``local_prefix / local_suffix``: an object's local path, and as a string its cache key."""
    return local_prefix / local_suffix


# The plugin's own methods, kept by install_folder_inventory.
_plugin_post_init = None
_plugin_valid_query = None
_valid_query_result = None  # the storage interface's StorageQueryValidationResult


@functools.cache
def _query_check(query: str):
    # A plain s3://bucket/key query is one the plugin accepts (urlparse's scheme is "s3", and it
    # has none of the characters that make urlparse raise); anything else, it judges.
    if parse_query(query) is not None:
        return _valid_query_result(query=query, valid=True)
    return _plugin_valid_query(query)


def _memoized_valid_query(cls, query: str):
    return _query_check(query)


# An ``s3://bucket/key`` query that ``urlparse`` and ``posixpath.normpath`` leave as it is: no
# URL delimiters, no empty, ``.`` or ``..`` segment, no trailing slash.
_PLAIN_QUERY = re.compile(r"s3://([^/?#;@:\[\]%\\\s]+)/((?:[^/?#;%\s]+/)*[^/?#;%\s]+)")
_SPECIAL_SEGMENT = re.compile(r"(?:^|/)\.\.?(?:/|$)")


@functools.cache
def parse_query(query: str) -> tuple[str, str] | None:
    """(bucket, key) of a plain ``s3://bucket/key`` query, split as the plugin's ``__post_init__``
    would (``urlparse``, then ``normpath``); None for anything else, which the plugin parses."""
    match = _PLAIN_QUERY.fullmatch(query)
    if match is None or _SPECIAL_SEGMENT.search(match.group(2)):
        return None
    return match.group(1), match.group(2)


def _post_init_from_plain_query(self) -> None:
    plain = parse_query(self.query)
    if plain is None:
        _plugin_post_init(self)
        return
    self.bucket, self.key = plain
    self._local_suffix = self._local_suffix_from_key(self.key)
    self._is_dir = None


def _memoized_local_path(self):
    if self._overwrite_local_path:
        return self._overwrite_local_path
    return _under(self.provider.local_prefix, self.local_suffix())


def _memoized_cache_key(self, local_suffix: str | None = None) -> str:
    assert self._overwrite_local_path is None, "no cache key applies to an overwritten local path"
    return str(_under(self.provider.local_prefix, local_suffix or self.local_suffix()))


def parse_timestamp(value):
    """A listed object's LastModified (``2026-12-04T17:30:05.000Z``) without dateutil, which
    took most of a listing's parse time; anything else goes to botocore's own parser."""
    if isinstance(value, str) and value.endswith("Z"):
        try:
            return datetime.datetime.fromisoformat(value[:-1] + "+00:00")
        except ValueError:
            pass
    from botocore.utils import parse_timestamp as botocore_parse_timestamp

    return botocore_parse_timestamp(value)


def _fast_timestamps(client) -> None:
    """Parse this client's timestamps with ``parse_timestamp``. The parser factory belongs to
    the client's botocore session; the values it yields are the same datetimes."""
    factory = getattr(getattr(client, "_endpoint", None), "_response_parser_factory", None)
    if factory is not None and not getattr(factory, _MARK, False):
        factory.set_parser_defaults(timestamp_parser=parse_timestamp)
        setattr(factory, _MARK, True)


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
    _fast_timestamps(client)
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


def _list_folders() -> None:
    import snakemake_storage_plugin_s3 as plugin

    plugin.StorageObject.get_inventory_parent = _folder_parent
    plugin.StorageObject.inventory = _folder_inventory


def _memoize_query_check() -> None:
    global _plugin_valid_query, _valid_query_result
    import snakemake_storage_plugin_s3 as plugin

    _plugin_valid_query = plugin.StorageProvider.is_valid_query  # bound to the class
    _valid_query_result = plugin.StorageQueryValidationResult
    plugin.StorageProvider.is_valid_query = classmethod(_memoized_valid_query)


def _parse_plain_queries() -> None:
    global _plugin_post_init
    import snakemake_storage_plugin_s3 as plugin

    _plugin_post_init = plugin.StorageObject.__post_init__
    plugin.StorageObject.__post_init__ = _post_init_from_plain_query


def _memoize_paths() -> None:
    import snakemake_storage_plugin_s3 as plugin

    plugin.StorageObject.local_path = _memoized_local_path
    plugin.StorageObject.cache_key = _memoized_cache_key


# The plugin 0.3.6's functions (and those of the storage interface and Snakemake 9.27.1 they
# rely on), as each patch was written against them.
PATCHES = [
    Patch(
        "inventory by folder",
        {
            f"{PLUGIN}:StorageObject.get_inventory_parent": "675db335307a725c",
            f"{PLUGIN}:StorageObject.inventory": "b58d02c76172ba53",
            f"{PLUGIN}:StorageObject._local_suffix_from_key": "a56309f3e211249b",
            "snakemake.io:ExistsDict.__contains__": "52633c333e7bd863",
            "snakemake.io:ExistsDict.__init__": "6ef8100d099c6e8d",
        },
        _list_folders,
    ),
    Patch(
        "query check memoized", {f"{PLUGIN}:StorageProvider.is_valid_query": "acf983d4ff04a1e3"}, _memoize_query_check
    ),
    Patch(
        "plain queries parsed without urlparse",
        {f"{PLUGIN}:StorageObject.__post_init__": "d0f604574d7c8fde"},
        _parse_plain_queries,
    ),
    Patch(
        "local paths and cache keys memoized",
        {
            f"{PLUGIN}:StorageObject.local_path": "809557749fb918ec",
            f"{PLUGIN}:StorageObject.cache_key": "60ea2332c4f7f231",
        },
        _memoize_paths,
    ),
]


def install_folder_inventory() -> list[str]:
    """Patch the S3 plugin's inventory to list folders (see the module docstring); the patches
    in place. Idempotent; each patch whose guarded function changed is left out with a warning;
    none without the plugin or with ``DFLASH_S3_FOLDER_INVENTORY=0``."""
    if os.environ.get(REQUEST_LOG_ENV):
        count_requests(os.environ[REQUEST_LOG_ENV])
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return []
    try:
        import snakemake_storage_plugin_s3 as plugin
    except ImportError:
        return []
    objects = plugin.StorageObject
    if not hasattr(objects, _MARK):
        setattr(objects, _MARK, install(PATCHES, "planning asks S3 more (3 requests per missing object)"))
    return list(getattr(objects, _MARK))

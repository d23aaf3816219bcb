"""The project's vLLM KV connector for the ``extract_hidden_states`` speculative method.

Loaded BY THE vLLM SERVER (``kv_connector_module_path``), in the engine's own environment: this
module imports only torch, safetensors and vLLM, never the pipeline (its folder is no package of
the pipeline's). ``engines.engine_taps`` copies it beside the server's run files and puts that
folder on the server's ``PYTHONPATH``.

``extract_hidden_states`` keeps each token's captured layers as one "KV cache" row [K, H] of a
cache-only attention layer. When a request finishes, its blocks stay allocated (``request_finished``
returns True) until the worker has copied its rows out; then it writes
``<storage_path>/<request id>.safetensors`` = {``hidden_states`` [T, K, H], ``token_ids`` [T],
``layer_ids`` [K]}: the rows of the prompt's T tokens, the captured vLLM layer ids in the order
of the K slots (ascending: vLLM sorts them), and the ids the rows belong to, for the client to
check. The file is written under a temporary name and renamed, so a reader sees all of it or
nothing; the response's ``kv_transfer_params.hidden_states_path`` names it.

Why not vLLM's ``ExampleHiddenStatesConnector``: it copies through a pinned host buffer on a CUDA
stream, which fails on vLLM's CPU build (``pin_memory=True requires a CUDA or other accelerator
backend``), and its private helpers change between releases. This one gathers a finished request's
rows on the device before its blocks are released, copies them to a reused host buffer (pinned, on a
side stream, where the cache is on a GPU) and writes the file on a thread of its own once the copy
is done (``taps_host_copies.RowsToHost``), and uses only the connector base class's interface.
Every tensor-parallel rank reports each request done (only rank 0 writes), so vLLM's default
count of finished notifications (one per worker) holds on every version.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

# The connector's folder is on the engine's PYTHONPATH (engines.engine_taps copies both modules).
from taps_host_copies import RowsToHost, host_copy_for

CONNECTOR_NAME = "DFlashTapsConnector"

# Beside a taps file that could not be written: ``<file>.failed``, holding the error, so that the
# client waiting for that file fails at once instead of waiting out its request timeout (the
# engine's own stop comes only at its next step, which may never come). The client
# (``engines.engine_taps``) spells the same suffix.
FAILED_SUFFIX = ".failed"


def write_taps_file(path: str, rows: torch.Tensor, token_ids: list[int], layer_ids: list[int]) -> None:
    """``path`` = {hidden_states [T, K, H], token_ids [T], layer_ids [K]}, under a temporary name
    and renamed: a reader sees all of it or nothing. A write that fails leaves ``path`` +
    ``FAILED_SUFFIX`` with the error for the reader, then raises."""
    partial = path + ".partial"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_file(
            {
                "hidden_states": rows.contiguous(),
                "token_ids": torch.tensor(token_ids, dtype=torch.long),
                "layer_ids": torch.tensor(layer_ids, dtype=torch.long),
            },
            partial,
        )
        os.replace(partial, path)
    except BaseException as exc:
        _leave_failure(path, f"{type(exc).__name__}: {exc}")
        raise


def _write_rows(rows: torch.Tensor, path: str, token_ids: list[int], layer_ids: list[int]) -> None:
    """``write_taps_file`` with the host rows first, as ``RowsToHost`` hands them."""
    write_taps_file(path, rows, token_ids, layer_ids)


def _leave_failure(path: str, why: str) -> None:
    """The failure marker of ``path`` (best effort: the file system that failed the write may fail
    this too; the engine's stop still follows at its next step)."""
    try:
        if os.path.exists(path + ".partial"):
            os.remove(path + ".partial")
        with open(path + FAILED_SUFFIX + ".partial", "w") as out:
            out.write(why)
        os.replace(path + FAILED_SUFFIX + ".partial", path + FAILED_SUFFIX)
    except OSError:
        pass


@dataclass
class TapsToWrite:
    req_id: str
    path: str
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class TapsConnectorMetadata(KVConnectorMetadata):
    to_write: list[TapsToWrite] = field(default_factory=list)


def _hidden_state_group(kv_cache_config) -> int:
    """The KV cache group of the hidden-state layer (the only group of a dense target's
    extraction; a hybrid target has more)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    found = [i for i, g in enumerate(groups) if type(g.kv_cache_spec).__name__ == "HiddenStateCacheSpec"]
    if len(found) == 1:
        return found[0]
    if len(groups) <= 1:
        return 0
    raise ValueError(f"cannot tell the hidden-state cache group among {len(groups)} groups")


def _group_block_size(kv_cache_config, group: int, default: int) -> int:
    """Tokens per block of the hidden-state cache group: on a hybrid target vLLM 0.34 gives each
    cache group its own page-aligned block size (v1/core/kv_cache_planning.py), so the hidden
    states' is not cache_config.block_size there; one group (a dense target) has that one."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if 0 <= group < len(groups):
        spec = getattr(groups[group], "kv_cache_spec", None)
        if getattr(spec, "block_size", None):
            return int(spec.block_size)
    return default


def token_axis(shape: Sequence[int], block_size: int, num_layers: int) -> int:
    """The axis of a block's tokens in the hidden-state cache: vLLM 0.26 lays it out [blocks,
    tokens, layers, hidden], 0.32 [blocks, layers, tokens, hidden]. Where a block holds as many
    tokens as there are layers, the cache-only backend's own shape rule says which."""
    if shape[1] != shape[2]:
        if block_size not in (shape[1], shape[2]) or num_layers not in (shape[1], shape[2]):
            raise ValueError(
                f"hidden-state cache of shape {tuple(shape)}: no axis of {block_size} tokens and {num_layers} layers"
            )
        return 1 if shape[1] == block_size else 2
    from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionBackend

    try:
        return 1 if CacheOnlyAttentionBackend.get_kv_cache_shape(2, 3, 5, 7)[1] == 3 else 2
    except (AttributeError, NotImplementedError):  # 0.32: no shape rule of its own, the layout decides
        return 2


class DFlashTapsConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        if "shared_storage_path" not in extra:
            raise ValueError(f"{CONNECTOR_NAME} needs kv_connector_extra_config.shared_storage_path")
        self.storage_path = str(extra["shared_storage_path"])
        spec = vllm_config.speculative_config
        if spec is None or spec.method != "extract_hidden_states":
            raise ValueError(f"{CONNECTOR_NAME} works only with the extract_hidden_states speculative method")
        # The order vLLM fills the slots in: ascending ids, each once.
        self.layer_ids = sorted(set(spec.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids))
        self.group = _hidden_state_group(kv_cache_config)
        self.block_size = _group_block_size(kv_cache_config, self.group, vllm_config.cache_config.block_size)
        # scheduler side
        self._paths: dict[str, str] = {}
        self._to_write: list[TapsToWrite] = []
        # worker side
        self._cache: torch.Tensor | None = None
        self._rank_zero = True
        self._writes: RowsToHost | None = None

    # --- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False  # writes only: nothing is ever loaded from outside

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        pass

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        for new in scheduler_output.scheduled_new_reqs:
            self._paths[new.req_id] = os.path.join(self.storage_path, f"{new.req_id}.safetensors")
        meta = TapsConnectorMetadata(to_write=self._to_write)
        self._to_write = []
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        path = self._paths.pop(request.request_id, None)
        if path is None or request.prompt_token_ids is None:
            return False, None  # never scheduled (aborted early), or no token ids to check against
        self._to_write.append(TapsToWrite(request.request_id, path, list(request.prompt_token_ids), list(block_ids)))
        # Keep the blocks until the worker has copied the rows out.
        return True, {"hidden_states_path": path}

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        if not 0 <= self.group < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self.group])

    # --- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._rank_zero = get_tensor_model_parallel_rank() == 0
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        try:
            from vllm.config import get_layers_from_vllm_config
        except ImportError:  # older releases keep it in vllm.config.vllm
            from vllm.config.vllm import get_layers_from_vllm_config

        layers = get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches))
        if len(layers) != 1:
            raise ValueError(f"expected one hidden-state cache layer, found {len(layers)}")
        self._cache = kv_caches[next(iter(layers))]
        # The scheduler's block ids count blocks of the group's size: a cache whose token axis
        # disagrees would be read at the wrong rows, so token_axis refuses it.
        self._token_axis = token_axis(self._cache.shape, self.block_size, len(self.layer_ids))
        self._writes = RowsToHost(host_copy_for(self._cache.device))

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        pass  # the rows are in the cache already; copied out when the request finishes

    def wait_for_save(self):
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._writes is not None:
            self._writes.settle()
        done: set[str] = set()
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, TapsConnectorMetadata):
                for item in meta.to_write:
                    if self._rank_zero:
                        # The rows leave the cache now (its blocks are released once reported
                        # done); their copy to the host and the file follow in the background.
                        self._writes.submit(self._rows(item), _write_rows, item.path, item.token_ids, self.layer_ids)
                    done.add(item.req_id)
        return done or None, None

    def _rows(self, item: TapsToWrite) -> torch.Tensor:
        """The request's rows [T, K, H], gathered on the cache's device."""
        block_size = self._cache.shape[self._token_axis]
        blocks = torch.tensor(item.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * block_size + torch.arange(block_size)[None, :]).flatten()
        slots = slots[: len(item.token_ids)].to(self._cache.device)
        if self._token_axis == 1:
            rows = self._cache[slots // block_size, slots % block_size]
        else:
            rows = self._cache[slots // block_size, :, slots % block_size]
        # [T, K, H] either way, in storage of its own (indexing by a tensor copies: the cache's
        # blocks may be reused once the request is reported done, before the host has the rows).
        return rows

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        # A token's K rows together, the layout extract_hidden_states writes. "NHD" is the name
        # every release knows: 0.32 reads it as LBNHC; 0.26's attention backends know no LBNHC.
        return "NHD"

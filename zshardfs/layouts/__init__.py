"""Sharded layouts.  Each module exposes the same four functions:

- ``probe(ctx, dir_key) -> Dataset | None``
- ``is_document(key) -> bool``: cheap name test for metadata it may rewrite
- ``rewrite_document(key, data) -> bytes | None``
- ``dataset_dirs(key, data) -> list[str]``: the directories whose datasets
  the document at ``key`` (stored bytes ``data``) describes

and optionally ``accept_document(key, new, stored, shard_option)`` (what to
store when a document is written through the view) and its variant with
storage reads, ``async accept_document_async(ctx, key, new, stored,
shard_option, pending, previous)``, where ``pending(dir_key)`` names what
the view holds only in memory in a directory, and ``previous`` is the last
document stored at ``key`` that this mount removed or emptied (None: none
remembered; given when no document is stored there now).

``LAYOUTS`` is the order in which the view asks them.
"""

from . import precomputed, zarr_sharding, zarr_transformer

LAYOUTS = [zarr_sharding, zarr_transformer, precomputed]

"""Write arrays with zarr-python 2.18's sharding *storage transformer* (v3 draft) and twins.

Run under /work/main/.venv-zarr2/bin/python with ZARR_V3_EXPERIMENTAL_API=1 and
ZARR_V3_SHARDING=1; argv[1] is a job JSON written by peers_zarr.write_zarr2_hierarchy:
{"sharded_root", "twin_root", "root_attributes", "arrays": [{path, shape, dtype, chunks,
chunks_per_shard, compressor, separator, fill_value, attributes, pattern,
write_empty_chunks, data (.npy path)}]}. The twin is written by the same API without the
storage transformer, so its chunks are the inner chunks.

What zarr 2.18.7 writes (checked by running it, DirectoryStoreV3):
  zarr.json                          entry point: {"extensions": [], "metadata_encoding":
                                     ".../protocol/core/3.0", "metadata_key_suffix": ".json",
                                     "zarr_format": "https://purl.org/zarr/spec/protocol/core/3.0"}
  meta/root.group.json               root group ({"attributes": {...}})
  meta/root/<p>.group.json           explicit groups (implicit groups have no document)
  meta/root/<p>.array.json           array: attributes, chunk_grid {chunk_shape (INNER chunk
                                     shape), separator, type: "regular"}, chunk_memory_layout
                                     "C", compressor {codec: ".../codec/<id>/1.0",
                                     configuration} (key absent without compressor),
                                     data_type "<u2"/">f4"/"|i1"..., dimension_separator (same
                                     as chunk_grid.separator), extensions [], fill_value, shape,
                                     storage_transformers: [{"extension":
                                     "https://purl.org/zarr/spec/storage_transformers/sharding/1.0",
                                     "type": "indexed", "configuration":
                                     {"chunks_per_shard": [2, 2]}}]; keys sorted, indent 4.
                                     Without a transformer the key is absent.
  data/root/<p>/c<i><sep><j>...      shards at SHARD grid coordinates (chunk coordinate //
                                     chunks_per_shard) with the array's separator: "/" gives
                                     c0/1, "." gives c0.1. Twin chunks use the same spelling at
                                     chunk coordinates.
  0-d arrays                         key c0 (sharded and twin); chunks_per_shard () is
                                     stored as [1].
  Shard format: chunks back to back, then the index: little-endian uint64 (offset, nbytes)
  per chunk in C order, 16 bytes * prod(chunks_per_shard), no checksum; empty = 2^64-1 twice.
  A shard whose chunks all become empty is deleted. write_empty_chunks defaults to True
  here (False is passed explicitly by the cases that want sparse stores).
Quirk: reading the metadata back imports zarr.tests.test_storage_v3 (for a dummy
transformer), which imports pytest; the zarr 2 venv has no pytest, so the decoder is
patched below to know only the sharding transformer.
"""

import json
import sys

import numcodecs
import numpy as np
import zarr
import zarr.meta
from zarr._storage.v3 import DirectoryStoreV3
from zarr._storage.v3_storage_transformers import ShardingStorageTransformer


def _decode_transformer(cls, meta):
    assert meta["extension"] == ShardingStorageTransformer.extension_uri, meta
    return ShardingStorageTransformer.from_config(meta["type"], meta.get("configuration", {}))


zarr.meta.Metadata3._decode_storage_transformer_metadata = classmethod(_decode_transformer)

COMPRESSORS = {
    None: lambda: None,
    "gzip": lambda: numcodecs.GZip(level=5),
    "zstd": lambda: numcodecs.Zstd(level=3),
    "blosc": lambda: numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE),
}


def write(root, spec, sharded, data):
    store = DirectoryStoreV3(root)
    parts = spec["path"].split("/")[:-1]
    for i in range(1, len(parts) + 1):
        g = zarr.group(store=store, path="/".join(parts[:i]), zarr_version=3)
        g.attrs["group"] = "/".join(parts[:i])
    transformers = []
    if sharded:
        transformers = [ShardingStorageTransformer("indexed", chunks_per_shard=tuple(spec["chunks_per_shard"]))]
    z = zarr.create(
        shape=tuple(spec["shape"]), chunks=tuple(spec["chunks"]), dtype=spec["dtype"],
        store=store, path=spec["path"], zarr_version=3, storage_transformers=transformers,
        compressor=COMPRESSORS[spec["compressor"]](), fill_value=spec["fill_value"],
        dimension_separator=spec["separator"], write_empty_chunks=spec["write_empty_chunks"],
        overwrite=True,
    )
    if spec["attributes"]:
        z.attrs.update(spec["attributes"])
    if spec["pattern"] != "empty":
        z[...] = data


def main(job_path):
    job = json.load(open(job_path))
    for root in (job["sharded_root"], job["twin_root"]):
        g = zarr.group(store=DirectoryStoreV3(root), zarr_version=3)
        if job["root_attributes"]:
            g.attrs.update(job["root_attributes"])
    for spec in job["arrays"]:
        data = np.load(spec["data"]).astype(spec["dtype"])
        write(job["sharded_root"], spec, True, data)
        write(job["twin_root"], spec, False, data)


if __name__ == "__main__":
    main(sys.argv[1])

"""The replay store: each sequence's target features kept once, read back instead of a target forward.

`pool.replay` (off | local | an absolute folder or URI) and `pool.replay_max_gb`. The targets write
what they compute; later epochs, a resumed run and a later run with the same key read it back:
- `key.py`: what features depend on besides the tokens (the target's weights, its layers, the payload
  dtype) -> the store's folder; each sequence is named by the digest of its token ids;
- `entry.py`: one sequence's features as a file: a JSON header (size, dtype, sha256) and raw bytes,
  checked on every read (nothing is unpickled);
- `backend.py`: a local folder (tmp + link, write-once) or a `pyarrow.fs` URI;
- `store.py`: the manifest, the byte budget, get / put;
- `jobs.py`: a job's `HiddenBatch` assembled from its sequences' entries, or written out after a forward;
- `target_side.py`: what the TargetActor calls (lookup, keep), with a background writer;
- `spec.py`: the config's setting as the actors receive it.
"""

"""Where checkpoints, the export and the summary go: a local folder or a URI that `pyarrow.fs` opens.

`roots.py`: what a root is (a path or a URI, its name, its local folders, its credentials hidden in
print); `publish.py`: the storage over a root and how an entry is published atomically (a rename on
disk, a marker written last on object stores); `fetch.py`: a published folder brought onto this
node; `local_cache.py`: this user's local disk for URI runs (staging, stale leftovers, the download
cache bounded in bytes); `owner.py`: the boot and pid namespace that make a recorded pid mean a process; `pins.py`: the lock a reader holds on a cached download so that nothing evicts or
replaces it meanwhile; `cache_use.py`: what the cache holds after several runs, against its bound; `names.py`: every name a listing returns checked to stay inside its folder before
anything is deleted or downloaded; `orphans.py`: the names written into a local checkpoint folder for
a moment (one fixed prefix) and the start-up cleanup of what a crash left of them; `fence.py`: the
fencing token that refuses a publish, commit, delete or write by a run that lost its lease; `claim.py`: the
entries a new lease holder found, so that a stale run's later commit is never its resume point;
`conditional.py`: create-if-absent and replace-if-unchanged of one object on S3 and GCS (the lease), and
the conditional put and delete of what a run rewrites or removes in place. Transient storage errors are retried by the
S3 and GCS clients themselves (`uri_storage.with_retries`).
"""

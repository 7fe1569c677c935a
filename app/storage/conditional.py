"""Conditional writes of one small object on S3 (and MinIO, and other S3-compatible stores): create it
only if absent, replace it only if unchanged. `pyarrow.fs` has neither, so a run lease taken through it
(read, write, read back) let two drivers both win; with these exactly one does.

The client is boto3 (S3's `If-None-Match: *` and `If-Match: <etag>` on PutObject), built from the same
`s3://bucket/prefix?endpoint_override=host:port&scheme=http&region=...` URI pyarrow opens, with the
credentials from the environment as pyarrow takes them.

On `gs://` the same two writes are GCS's JSON API preconditions (`ifGenerationMatch=0`: create only if
absent; `ifGenerationMatch=<generation>`: replace only that version), sent with google-auth's
credentials (`google.auth.default`, as pyarrow finds them) over requests; a `scheme=http` URI (an
emulator, `endpoint_override=host:port`) goes unauthenticated, as pyarrow does there.

`conditional_store(root)` is None where the client is not installed (boto3; google-auth and requests) or
the root is neither: the caller falls back to what pyarrow offers.

Besides the lease, these guard what a run that may have lost its folder deletes or rewrites in place
(app/storage/uri_storage.py): `version` reads which version of an object is there, and `put_file` and
`remove` act only if that version is still the one read (none read: `put_file` only creates).
"""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

# Another writer got in first (or the object it was to replace is gone): the condition failed.
_LOST = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409", "NoSuchKey", "404"}


@dataclass(frozen=True)
class Versioned:
    """An object's bytes and the ETag that names this version of it."""

    data: bytes
    etag: str


class ConditionalStore:
    """Create-if-absent and replace-if-unchanged of objects under one s3:// prefix."""

    def __init__(self, root: str) -> None:
        import boto3

        parts = urlsplit(root)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        endpoint = query.get("endpoint_override")
        scheme = query.get("scheme", "https")
        self.client = boto3.client("s3", region_name=query.get("region"),
                                   endpoint_url=f"{scheme}://{endpoint}" if endpoint else None)
        self.bucket, self.prefix = parts.netloc, parts.path.strip("/")

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def create(self, rel: str, data: bytes) -> str | None:
        """Write `rel` only if no object is there; its ETag, or None when one already was."""
        return self._put(rel, data, IfNoneMatch="*")

    def replace(self, rel: str, data: bytes, etag: str) -> str | None:
        """Write `rel` only if it is still the version `etag`; the new ETag, or None when it changed."""
        return self._put(rel, data, IfMatch=etag)

    def read(self, rel: str) -> Versioned | None:
        """`rel`'s bytes and ETag, or None when there is no such object."""
        try:
            got = self.client.get_object(Bucket=self.bucket, Key=self._key(rel))
        except self.client.exceptions.NoSuchKey:
            return None
        return Versioned(got["Body"].read(), got["ETag"])

    def delete(self, rel: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(rel))

    def version(self, rel: str) -> str | None:
        """The ETag of the object at `rel` now, or None when there is none."""
        from botocore.exceptions import ClientError

        try:
            return self.client.head_object(Bucket=self.bucket, Key=self._key(rel))["ETag"]
        except ClientError as e:
            if str(e.response.get("Error", {}).get("Code")) in _LOST | {"NotFound"}:
                return None
            raise

    def remove(self, rel: str, etag: str) -> bool:
        """Delete `rel` only if it is still the version `etag` (S3's conditional DeleteObject); False when
        it changed or is gone."""
        return self._call(self.client.delete_object, rel, IfMatch=etag) is not None

    def put_file(self, rel: str, local, etag: str | None) -> str | None:
        """Upload the local file `local` to `rel` in one PUT (streamed from the file) only if `rel` is still
        the version `etag` (None: only if there is no object); the new ETag, or None when the condition
        failed."""
        with open(local, "rb") as body:
            condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
            got = self._call(self.client.put_object, rel, Body=body, **condition)
        return None if got is None else got["ETag"]

    def _put(self, rel: str, data: bytes, **condition) -> str | None:
        got = self._call(self.client.put_object, rel, Body=data, **condition)
        return None if got is None else got["ETag"]

    def _call(self, method, rel: str, **kwargs) -> dict | None:
        """`method` on `rel`'s key; None when its condition failed (another writer got in first)."""
        from botocore.exceptions import ClientError

        try:
            return method(Bucket=self.bucket, Key=self._key(rel), **kwargs)
        except ClientError as e:
            if str(e.response.get("Error", {}).get("Code")) in _LOST:
                return None
            raise


class GcsConditionalStore:
    """Create-if-absent and replace-if-unchanged of objects under one gs:// prefix (JSON API generations;
    a version's "etag" here is its generation number)."""

    def __init__(self, root: str, session=None) -> None:
        parts = urlsplit(root)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        endpoint, scheme = query.get("endpoint_override"), query.get("scheme", "https")
        self.base = f"{scheme}://{endpoint}" if endpoint else "https://storage.googleapis.com"
        self.bucket, self.prefix = parts.netloc, parts.path.strip("/")
        self._session, self._anonymous = session, scheme == "http"

    @property
    def session(self):
        """The HTTP session, made at first use (credentials are looked up then, after the root's check)."""
        if self._session is None:
            self._session = _gcs_session(self._anonymous)
        return self._session

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _object_url(self, rel: str) -> str:
        from urllib.parse import quote

        return f"{self.base}/storage/v1/b/{quote(self.bucket, safe='')}/o/{quote(self._key(rel), safe='')}"

    def create(self, rel: str, data: bytes) -> str | None:
        """Write `rel` only if no object is there; its generation, or None when one already was."""
        return self._put(rel, data, "0")

    def replace(self, rel: str, data: bytes, etag: str) -> str | None:
        """Write `rel` only if it is still generation `etag`; the new generation, or None when it changed."""
        return self._put(rel, data, etag)

    def read(self, rel: str) -> Versioned | None:
        """`rel`'s bytes and generation, or None when there is none: the live generation from the object's
        metadata, then that very generation's bytes (replaced in between: asked again)."""
        for _ in range(5):
            meta = self.session.get(self._object_url(rel), timeout=30)
            if meta.status_code == 404:
                return None
            meta.raise_for_status()
            generation = str(meta.json()["generation"])
            got = self.session.get(self._object_url(rel), params={"alt": "media", "generation": generation}, timeout=30)
            if got.status_code != 404:
                got.raise_for_status()
                return Versioned(got.content, generation)
        raise OSError(f"gs://{self.bucket}/{self._key(rel)} kept changing while it was read")

    def delete(self, rel: str) -> None:
        gone = self.session.delete(self._object_url(rel), timeout=30)
        if gone.status_code != 404:
            gone.raise_for_status()

    def version(self, rel: str) -> str | None:
        """The live generation of `rel`, or None when there is none."""
        meta = self.session.get(self._object_url(rel), timeout=30)
        if meta.status_code == 404:
            return None
        meta.raise_for_status()
        return str(meta.json()["generation"])

    def remove(self, rel: str, etag: str) -> bool:
        """Delete `rel` only if it is still generation `etag`; False when it changed or is gone."""
        gone = self.session.delete(self._object_url(rel), params={"ifGenerationMatch": etag}, timeout=30)
        if gone.status_code in (404, 409, 412):
            return False
        gone.raise_for_status()
        return True

    def put_file(self, rel: str, local, etag: str | None) -> str | None:
        """Upload the local file `local` (streamed) only if `rel` is still generation `etag` (None: only if
        absent); the new generation, or None when the condition failed."""
        with open(local, "rb") as body:
            return self._put(rel, body, etag or "0")

    def _put(self, rel: str, data, generation: str) -> str | None:
        url = f"{self.base}/upload/storage/v1/b/{self.bucket}/o"
        put = self.session.post(url, params={"uploadType": "media", "name": self._key(rel), "ifGenerationMatch": generation},
                                data=data, headers={"Content-Type": "application/json"}, timeout=30)
        if put.status_code in (404, 409, 412):  # another writer got in first, or the version is gone
            return None
        put.raise_for_status()
        return str(put.json()["generation"])


def _gcs_session(anonymous: bool):
    import requests

    if anonymous:
        return requests.Session()
    import google.auth
    from google.auth.transport.requests import AuthorizedSession

    credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/devstorage.read_write"])
    return AuthorizedSession(credentials)


def conditional_store(root: str) -> ConditionalStore | GcsConditionalStore | None:
    """A conditional store for an s3:// or gs:// root, or None (another scheme, or its client not installed)."""
    scheme = urlsplit(str(root)).scheme
    try:
        if scheme == "s3":
            import boto3  # noqa: F401

            return ConditionalStore(str(root))
        if scheme in ("gs", "gcs"):
            import google.auth  # noqa: F401
            import requests  # noqa: F401

            return GcsConditionalStore(str(root))
    except ImportError:
        return None
    return None

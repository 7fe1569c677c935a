"""Conditional writes of one small object on S3 (and MinIO, and other S3-compatible stores): create it
only if absent, replace it only if unchanged. `pyarrow.fs` has neither, so a run lease taken through it
(read, write, read back) let two drivers both win; with these exactly one does.

The client is boto3 (S3's `If-None-Match: *` and `If-Match: <etag>` on PutObject), built from the same
`s3://bucket/prefix?endpoint_override=host:port&scheme=http&region=...` URI pyarrow opens, with the
credentials from the environment as pyarrow takes them. `conditional_store(root)` is None where boto3
is not installed or the root is not s3://: the caller falls back to what pyarrow offers.
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

    def _put(self, rel: str, data: bytes, **condition) -> str | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.put_object(Bucket=self.bucket, Key=self._key(rel), Body=data, **condition)["ETag"]
        except ClientError as e:
            if str(e.response.get("Error", {}).get("Code")) in _LOST:
                return None
            raise


def conditional_store(root: str) -> ConditionalStore | None:
    """A `ConditionalStore` for an s3:// root, or None (another scheme, or boto3 not installed)."""
    if urlsplit(str(root)).scheme != "s3":
        return None
    try:
        import boto3  # noqa: F401
    except ImportError:
        return None
    return ConditionalStore(str(root))

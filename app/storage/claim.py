"""What a new lease holder found in its folder when it took it: the entries (checkpoints, exports) of older
fencing tokens it may build on. Anything of an older token that is not among them landed after the
takeover, from a run that lost the folder while paused between its last fence check and its commit.

The fencing token alone does not tell such an entry apart: until the new holder publishes its first
checkpoint, an older token is all the folder holds, and a stale commit of a higher step than the new
holder resumed from would be the newest checkpoint, the one a rebuild of the new holder's drafter
group resumes from (its generation stamp need not tell either: both runs may have counted the same
next generation). So each new holder writes `<root>/.run-claim` right after its counter (app/run/lease.py,
and fence.extend for a sweep run's folder), before it reads its resume point:

    {"token": <its token>, "entries": [[<name>, <token>, <version>], ...]}

(`<version>`: the `v-<nonce>` an object store's marker names; a local entry's own name) and `landed_after`
names the entries a reader must ignore: a token above 0 and below the claim's, and not listed with that
token and version (a stale run's rewrite of a listed name has another version). The version, not the
whole location, so a later run that spells the root another way (an endpoint alias) still finds them. An entry the previous claim already ruled out stays out of the new
one, so a later holder never adopts it either. Only the lease holder writes the claim (a `.run-` file:
fence.guard leaves it to the lease); a claim that does not parse is ignored (the folder is judged as
before claims were), as is a folder no lease touched.
"""
from __future__ import annotations

import json
from urllib.parse import urlsplit

CLAIM_FILE = ".run-claim"
MAX_ENTRIES = 100_000  # a claim listing more is not one this project wrote


def write(store, token: int) -> None:
    """Record the entries `store` holds now (those an earlier claim did not rule out) under `token`."""
    entries = store.entries("")
    out = landed_after(store, entries)
    kept = [[e.name, e.token, _version(e)] for e in entries if e.name not in out]
    store.write_file(CLAIM_FILE, json.dumps({"token": int(token), "entries": kept}).encode())


def landed_after(store, entries) -> set[str]:
    """Names of `entries` published under an older token than the folder's claim and not in it."""
    claim = read(store)
    if claim is None:
        return set()
    token, known = claim
    return {e.name for e in entries if 0 < e.token < token and (e.name, e.token, _version(e)) not in known}


def _version(entry) -> str:
    """The last part of an entry's location: its version on an object store, its name in a local folder."""
    location = str(entry.location)
    path = urlsplit(location).path if "://" in location else location
    return path.rstrip("/").rsplit("/", 1)[-1]


def read(store) -> tuple[int, set[tuple[str, int, str]]] | None:
    """(token, the entries it lists) of the folder's claim; None when there is none or it does not parse
    (hostile input: anything but the exact shape `write` makes is no claim)."""
    try:
        data = json.loads(store.read_file(CLAIM_FILE) or b"null")
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or not _count(data.get("token")) or not isinstance(data.get("entries"), list):
        return None
    rows = data["entries"]
    if len(rows) > MAX_ENTRIES or not all(_row(r) for r in rows):
        return None
    return data["token"], {(r[0], r[1], r[2]) for r in rows}


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _row(row) -> bool:
    return isinstance(row, list) and len(row) == 3 and isinstance(row[0], str) and _count(row[1]) \
        and isinstance(row[2], str)

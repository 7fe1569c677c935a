"""Starting or joining a Ray cluster safely: one place for the driver, the tools and the benches.

A throwaway local cluster gets Ray's token auth with a fresh secret (its GCS listens on the node's
address); joining `RAY_ADDRESS` keeps whatever auth that cluster uses.
"""
from __future__ import annotations

import os


def init_ray() -> None:
    """Join RAY_ADDRESS, or start our own throwaway local cluster with Ray's default token auth: its GCS
    listens on the node's address, so without a token any process that reaches it could list and call
    the pool. The token is a fresh secret in this process's environment (inherited by the cluster's
    processes), not Ray's ~/.ray/auth_token, which Ray writes readable by every user; an explicit
    RAY_AUTH_MODE (tests set `disabled`) or token setting is kept."""
    import ray

    address = os.environ.get("RAY_ADDRESS") or None
    if address in (None, "local"):
        local_cluster_token()
    ray.init(address=address, include_dashboard=None if address else False, log_to_driver=True,
             configure_logging=False)


def local_cluster_token() -> None:
    """Before starting a throwaway local cluster: unless RAY_AUTH_MODE or a token is set, give it a fresh
    token (256 bits, as Ray's own generator) in the environment its processes inherit (see init_ray)."""
    if "RAY_AUTH_MODE" not in os.environ and not {"RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"} & set(os.environ):
        import secrets

        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


def start_own_cluster(**resources) -> None:
    """A bench's own local cluster with these resources, even when RAY_ADDRESS is set or another cluster
    runs on the machine (plain ray.init would join it and refuse num_cpus/num_gpus), with token auth."""
    import ray

    local_cluster_token()
    ray.init(address="local", include_dashboard=False, configure_logging=False, log_to_driver=False, **resources)

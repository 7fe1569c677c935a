"""Issue 35 S7: the process group's data sockets listen on the rank's own interface, not wherever the
machine's hostname resolves (another interface, or loopback). torch's gloo takes its device only from
GLOO_SOCKET_IFNAME (init_process_group ignores gloo options); NCCL's bootstrap from NCCL_SOCKET_IFNAME.
Each rank sets both to the interface holding its address towards rank 0, unless the user set them."""
from __future__ import annotations

import os

import pytest

from app.training import rendezvous
from app.training.rendezvous import Rendezvous, pick_interface, socket_env

NODE = {"lo": ["127.0.0.1"], "docker0": ["172.17.0.1"], "eth0": ["203.0.113.7"], "ib0": ["10.0.0.5"]}


def test_the_interface_holding_the_rank_s_address_is_chosen() -> None:
    assert pick_interface("10.0.0.5", NODE) == "ib0"
    assert pick_interface("203.0.113.7", NODE) == "eth0"
    assert pick_interface("127.0.0.1", NODE) == "lo"
    assert pick_interface("192.168.1.1", NODE) is None


def test_both_libraries_get_it_and_nccl_as_an_exact_match() -> None:
    assert socket_env("10.0.0.5", NODE, {}) == {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "=ib0"}


def test_the_user_s_own_setting_wins_and_an_unknown_address_sets_nothing() -> None:
    assert socket_env("10.0.0.5", NODE, {"NCCL_SOCKET_IFNAME": "^docker"}) == {"GLOO_SOCKET_IFNAME": "ib0"}
    assert socket_env("10.0.0.5", NODE, {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}) == {}
    assert socket_env("192.168.1.1", NODE, {}) == {}


def test_a_rank_s_store_pins_its_sockets_before_the_group_is_made(monkeypatch) -> None:
    """Rank 0 on the loopback address (the only one every machine has): its store sets both variables to
    the loopback interface, and a one-rank gloo group is made through them."""
    import torch
    import torch.distributed as dist

    for var in rendezvous.SOCKET_VARS:
        monkeypatch.delenv(var, raising=False)
    loopback = pick_interface("127.0.0.1", rendezvous.interface_addresses())
    assert loopback is not None
    rdv = Rendezvous()
    ip, port = rdv.listen("127.0.0.1")
    store = rdv.store(ip, port, 1, True)
    assert (os.environ["GLOO_SOCKET_IFNAME"], os.environ["NCCL_SOCKET_IFNAME"]) == (loopback, f"={loopback}")
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()


def test_no_route_is_one_warning_and_the_libraries_choose(monkeypatch, capsys) -> None:
    def unroutable(peer: str) -> str:
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(rendezvous, "own_address", unroutable)
    for var in rendezvous.SOCKET_VARS:
        monkeypatch.delenv(var, raising=False)
    assert rendezvous.pin_sockets("10.9.9.9") == {}
    assert not any(var in os.environ for var in rendezvous.SOCKET_VARS)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GLOO_SOCKET_IFNAME" in err


@pytest.mark.parametrize("peer", ["127.0.0.1"])
def test_the_own_address_towards_a_peer_is_an_address_of_this_host(peer: str) -> None:
    assert rendezvous.own_address(peer) in {a for addrs in rendezvous.interface_addresses().values() for a in addrs}

"""Rank 0's rendezvous for torch.distributed: a socket listening on the node's own address (not every
interface), bound before the address is handed out and then served by the TCPStore itself, so the port
cannot be taken in between and nothing listens on other interfaces.

The process group's own data sockets are pinned the same way: gloo binds to whatever the machine's
hostname resolves to (another interface than the cluster's, or loopback), and `init_process_group` takes
no gloo device, only the `GLOO_SOCKET_IFNAME` variable (an interface name; NCCL's bootstrap reads
`NCCL_SOCKET_IFNAME`, where `=name` is an exact match). So before the group is made, each rank sets both
to the interface that holds its own address towards rank 0 (`socket_env`), unless the user set them.
"""
from __future__ import annotations

import os
import socket
import sys

SOCKET_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def pick_interface(own_ip: str, interfaces: dict[str, list[str]]) -> str | None:
    """The interface that holds `own_ip` (`interfaces`: name -> its addresses), or None."""
    return next((name for name, addrs in sorted(interfaces.items()) if own_ip in addrs), None)


def socket_env(own_ip: str, interfaces: dict[str, list[str]], env: dict[str, str]) -> dict[str, str]:
    """The variables to set so gloo's and NCCL's sockets use only `own_ip`'s interface: none already set
    by the user (theirs wins), none when no interface holds the address (left to the libraries)."""
    name = pick_interface(own_ip, interfaces)
    if name is None:
        return {}
    wanted = {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": f"={name}"}
    return {k: v for k, v in wanted.items() if not env.get(k)}


def own_address(peer: str) -> str:
    """This host's address on the route to `peer` (a UDP connect sends nothing; it only picks the route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        return s.getsockname()[0]


def interface_addresses() -> dict[str, list[str]]:
    """Each network interface's IPv4 address (Linux: SIOCGIFADDR); an interface without one is left out."""
    import fcntl
    import struct

    found: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            found[name] = [socket.inet_ntoa(packed[20:24])]
    return found


def pin_sockets(master_addr: str) -> dict[str, str]:
    """Set `socket_env` for this rank in its environment (before the process group is made); returns it."""
    try:
        chosen = socket_env(own_address(master_addr), interface_addresses(), dict(os.environ))
    except OSError as exc:  # no route, no ioctl: the libraries' own choice, said once
        print(f"WARNING: could not pin the process group's sockets to one interface ({exc}); set "
              "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME", file=sys.stderr, flush=True)
        return {}
    os.environ.update(chosen)
    return chosen


class Rendezvous:
    """One rank's side of the group's TCPStore: rank 0 `listen`s, every rank then opens the `store`."""

    def __init__(self) -> None:
        self.listener: socket.socket | None = None

    def listen(self, ip: str) -> tuple[str, int]:
        """Rank 0: bind a free port on `ip`; (ip, port) is the address the other ranks connect to."""
        self.listener = socket.create_server((ip, 0))
        return ip, self.listener.getsockname()[1]

    def store(self, master_addr: str, master_port: int, world_size: int, is_master: bool):
        """The rendezvous store: rank 0 serves it on the socket `listen` bound, the others connect. Also
        pins this rank's gloo / NCCL sockets to its interface towards rank 0 (`pin_sockets`)."""
        import torch.distributed as dist
        from torch.distributed.constants import default_pg_timeout

        pin_sockets(master_addr)  # the group's data sockets on this rank's interface towards rank 0, too
        listener = self.listener if is_master else None
        bound = {"master_listen_fd": listener.fileno()} if listener else {}
        store = dist.TCPStore(master_addr, master_port, world_size, is_master=is_master,
                              timeout=default_pg_timeout, **bound)
        if listener is not None:
            listener.detach()  # the store owns (and closes) the fd now; Python must not close it again
            self.listener = None
        return store

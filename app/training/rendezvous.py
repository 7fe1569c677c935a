"""Rank 0's rendezvous for torch.distributed: a socket listening on the node's own address (not every
interface), bound before the address is handed out and then served by the TCPStore itself, so the port
cannot be taken in between and nothing listens on other interfaces."""
from __future__ import annotations

import socket


class Rendezvous:
    """One rank's side of the group's TCPStore: rank 0 `listen`s, every rank then opens the `store`."""

    def __init__(self) -> None:
        self.listener: socket.socket | None = None

    def listen(self, ip: str) -> tuple[str, int]:
        """Rank 0: bind a free port on `ip`; (ip, port) is the address the other ranks connect to."""
        self.listener = socket.create_server((ip, 0))
        return ip, self.listener.getsockname()[1]

    def store(self, master_addr: str, master_port: int, world_size: int, is_master: bool):
        """The rendezvous store: rank 0 serves it on the socket `listen` bound, the others connect."""
        import torch.distributed as dist
        from torch.distributed.constants import default_pg_timeout

        listener = self.listener if is_master else None
        bound = {"master_listen_fd": listener.fileno()} if listener else {}
        store = dist.TCPStore(master_addr, master_port, world_size, is_master=is_master,
                              timeout=default_pg_timeout, **bound)
        if listener is not None:
            listener.detach()  # the store owns (and closes) the fd now; Python must not close it again
            self.listener = None
        return store

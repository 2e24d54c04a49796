"""A cluster's side channel, and the rendezvous relay that runs on it.

Owns: opening the notebook's end of the side channel (``ClientChannel``) on the cluster's
listen address, its signing key, and the messages the cluster itself answers on the
channel's I/O thread: ranks without an MPI world rendezvous through the notebook (rank 0
announces its store, the others ask until it is known; every message is answered), and
each rank's host (``hosts_seen``). The metrics store subscribes to the same channel for
everything else (``hvdnb.notebook.metrics.store.MetricsStore.attach``).

Never: block the channel thread, choose a fixed port, or listen on an address the caller
did not give (``0.0.0.0`` only when asked for).
"""

from __future__ import annotations

from typing import Any

import zmq

from hvdnb.notebook.cluster.channel import ClientChannel
from hvdnb.notebook.cluster.spec import ClusterError
from hvdnb.protocol import kinds

__all__ = ["Hub"]


class Hub:
    """The side channel of one start of a cluster, listening on ``ip``.

    Raises ClusterError when ``ip`` is not an address of this host.
    """

    def __init__(self, ip: str) -> None:
        try:
            self.channel = ClientChannel(ip=ip)
        except zmq.ZMQError as exc:
            raise ClusterError(
                f"cannot listen on {ip} ({exc}): --ip / HVDNB_IP must be an address of "
                "this host; leave it unset for 127.0.0.1"
            ) from None
        #: what the ranks connect to (``HVDNB_CHANNEL``)
        self.endpoint = f"tcp://{ip}:{self.channel.port}"
        self._rdv: dict[str, Any] = {}
        #: rank -> the host it said it runs on
        self.hosts_seen: dict[int, str] = {}
        ch = self.channel
        ch.on(kinds.RDV_ANNOUNCE, self._on_rdv_announce)
        ch.on(kinds.RDV_ASK, self._on_rdv_ask)
        ch.on(kinds.RANK_INFO, self._on_rank_info)

    def sign_with(self, key: str | bytes) -> None:
        """Sign and check messages with the cluster's session key from now on."""
        self.channel.key = key.encode() if isinstance(key, str) else bytes(key)

    def close(self) -> None:
        self.channel.close()

    # rendezvous through the notebook (ranks without an MPI world): rank 0 announces its
    # store, the others ask until it is known; every message is answered (channel thread)
    def _on_rdv_announce(self, msg: dict[str, Any]) -> None:
        if msg.get("rank") != 0:
            return
        self._rdv = {"addr": msg.get("addr"), "port": msg.get("port")}
        self.channel.send(0, kinds.RDV_OK, **self._rdv)

    def _on_rdv_ask(self, msg: dict[str, Any]) -> None:
        if self._rdv and isinstance(msg.get("rank"), int):
            self.channel.send(msg["rank"], kinds.RDV_STORE, **self._rdv)

    def _on_rank_info(self, msg: dict[str, Any]) -> None:
        if isinstance(msg.get("rank"), int) and msg.get("host"):
            self.hosts_seen[msg["rank"]] = str(msg["host"])

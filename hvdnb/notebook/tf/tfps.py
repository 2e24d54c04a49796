"""TensorFlow's ParameterServerStrategy coordinated from the notebook kernel.

``%dist start -n N --tf-ps K`` makes ranks ``0..K-1`` parameter servers and the other
``N-K`` workers; each serves ``tf.distribute.Server`` from its engine from the start until
``%dist stop`` (``hvdnb.rank.tfconfig``). The coordinator, TensorFlow's ``chief``, is this
kernel: the one controller of a notebook, as the chief is the one controller of TensorFlow's
own ParameterServerStrategy tutorial. An ordinary cell builds the strategy::

    import tensorflow as tf, hvdnb
    strategy = tf.distribute.ParameterServerStrategy(hvdnb.tf_cluster_resolver())
    coordinator = hvdnb.ClusterCoordinator(strategy)  # TF's, with the panel (``tfcoord``)

Owns: the resolver (the chief's address is chosen at start, in
``hvdnb.notebook.cluster.launch``, and passed to the ranks in their environment). Never:
import tensorflow before ``tf_cluster_resolver`` is called, or start a server itself (the
strategy starts the chief's when it is built).
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from hvdnb.notebook.cluster.lifecycle import Cluster, current
from hvdnb.notebook.cluster.spec import ClusterError

__all__ = ["ps_cluster", "tf_cluster_resolver"]


def _port_free(addr: str) -> bool:
    host, _, port = addr.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, int(port)))
        return True
    except OSError:
        return False


def ps_cluster(cluster: Cluster | None = None) -> Cluster:
    """``cluster`` (default: the current one) if it runs with parameter servers, else a
    ``ClusterError`` saying how to start one."""
    if cluster is not None and not hasattr(cluster, "running"):
        raise ClusterError(
            f"tf_cluster_resolver takes an hvdnb.Cluster (or nothing: the current one), not "
            f"{type(cluster).__name__} ({cluster!r})"
        )
    c = cluster or current()
    if c is None or not c.running:
        raise ClusterError(
            "no cluster is running: `%dist start -n 3 --tf-ps 1` starts 1 parameter server "
            "and 2 workers"
        )
    if not c.spec.tf_ps:
        raise ClusterError(
            f"this cluster of {c.n} ranks has no parameter servers: `%dist stop`, then "
            f"`%dist start -n {max(c.n, 2)} --tf-ps 1`"
        )
    return c


def tf_cluster_resolver(cluster: Cluster | None = None) -> Any:
    """The cluster resolver of a ParameterServerStrategy cluster, with this kernel as chief.

    Pass it to ``tf.distribute.ParameterServerStrategy`` in an ordinary (not
    ``%%distributed``) cell; build the strategy once per ``%dist start`` or ``restart``
    (each start gives the servers and this kernel's chief new ports; a second strategy on
    the same ports fails: the first one's chief server holds its port).

    Returns
    -------
    tf.distribute.cluster_resolver.SimpleClusterResolver
        ``task_type="chief"``, ``task_id=0``, ``rpc_layer="grpc"``

    Raises
    ------
    ClusterError : no cluster runs, it was started without ``--tf-ps``, or the chief's port
        is taken (a strategy was built on this cluster already, or another process took it)
    """
    c = ps_cluster(cluster)
    raw = c.client[0].apply_sync(os.getenv, "TF_CONFIG")  # rank 0 is ps 0: it knows them all
    cfg = json.loads(raw)
    spec = cfg["cluster"]
    if not _port_free(spec["chief"][0]):
        raise ClusterError(
            f"the coordinator's port {spec['chief'][0]} is taken (by a strategy this kernel "
            "built on this cluster already, or another process): reuse that strategy, or "
            "`%dist restart` for new ports"
        )
    import tensorflow as tf  # noqa: PLC0415 (optional, and seconds to import)

    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec), task_type="chief", task_id=0, rpc_layer="grpc"
    )

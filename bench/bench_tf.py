"""Training step time of bench_mlp's MLP in Keras on 2 ranks, and the per-call allreduce.

Run: ``mpiexec -n 2 python bench/bench_tf.py [--quick]``. The MLP 784-512-512-10 of
``bench_mlp.py`` as a tf-keras model (``TF_USE_LEGACY_KERAS=1``, Horovod's Keras), batch 64
per rank, SGD, one intra-op thread per rank, every step a ``tf.function``:

- ``hvdnb``: ``hvdnb.tensorflow.keras.DistributedOptimizer`` (``minimize`` with the tape);
- ``hvdnb_tape``: ``hvdnb.tensorflow.DistributedGradientTape`` (Horovod's TF2 loop);
- ``mwms``: ``tf.distribute.MultiWorkerMirroredStrategy`` (TF's own collectives over gRPC,
  ring), one worker per rank, the loss divided by the size (the strategy sums);
- ``hand_mpi``: the gradients concatenated and summed with mpi4py in one
  ``tf.numpy_function`` (the floor a Python-side sync can reach);
- ``no_comm``: the same step without communication.

Then the per-call allreduce, the choice behind ``hvdnb.tensorflow`` (run on hvdnb.torch's
negotiated MPI transport, or on TensorFlow's collectives): ``hvd.allreduce`` eagerly and
inside ``tf.function`` against the strategy's ``all_reduce`` inside ``tf.function`` and a
bare mpi4py ``Allreduce``, at 4 KB and at the MLP's gradient size; beside them a
``tf.function`` that only adds 0, the floor any call inside ``tf.function`` pays on the box. Variants are interleaved
block by block (machine noise hits them equally); each number is the median over blocks of
the slower rank's mean. Writes ``bench/results/tf.json`` on rank 0.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # Horovod's Keras API is Keras 2
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import json
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

COMM = MPI.COMM_WORLD.Dup()
N, RANK = COMM.Get_size(), COMM.Get_rank()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# MultiWorkerMirroredStrategy must exist before TensorFlow's context starts: TF_CONFIG first
_ports = COMM.allgather(_free_port())
os.environ["TF_CONFIG"] = json.dumps(
    {
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in _ports]},
        "task": {"type": "worker", "index": RANK},
    }
)
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)
STRATEGY: Any = None
MWMS_ERROR = ""
try:
    STRATEGY = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING
        )
    )
except Exception as exc:  # reported in the table as n/a
    MWMS_ERROR = f"{type(exc).__name__}: {exc}"

import hvdnb.tensorflow as hvd
import hvdnb.tensorflow.keras as hvd_keras

keras = tf.keras


def _model() -> Any:
    tf.random.set_seed(0)
    return keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def _steps(batch: int) -> tuple[dict[str, Callable[[], Any]], dict[str, Any]]:
    rng = np.random.default_rng(1 + RANK)
    X = tf.constant(rng.standard_normal((batch, 784), dtype=np.float32))
    Y = tf.constant(rng.integers(0, 10, batch))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    models: dict[str, Any] = {}

    def plain(sync: Callable[[list[Any]], list[Any]] | None) -> Callable[[], Any]:
        m = _model()
        opt = keras.optimizers.SGD(0.01)

        @tf.function
        def step() -> Any:
            with tf.GradientTape() as tape:
                loss = loss_fn(Y, m(X, training=True))
            g = tape.gradient(loss, m.trainable_variables)
            if sync is not None:
                g = sync(g)
            opt.apply_gradients(zip(g, m.trainable_variables))
            return loss

        models["no_comm" if sync is None else "hand_mpi"] = m
        return step

    def hand_sync(grads: list[Any]) -> list[Any]:
        sizes = [int(np.prod(g.shape)) for g in grads]

        def allreduce(*gs: np.ndarray) -> np.ndarray:
            flat = np.concatenate([g.reshape(-1) for g in gs])
            COMM.Allreduce(MPI.IN_PLACE, flat, MPI.SUM)
            flat /= N
            return flat

        flat = tf.numpy_function(allreduce, grads, tf.float32, stateful=True)
        return [tf.reshape(p, g.shape) for p, g in zip(tf.split(flat, sizes), grads)]

    m_hvd = models["hvdnb"] = _model()
    opt_hvd = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.01))

    @tf.function
    def step_hvd() -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(Y, m_hvd(X, training=True))
        opt_hvd.minimize(loss, m_hvd.trainable_variables, tape=tape)
        return loss

    m_tape = models["hvdnb_tape"] = _model()
    opt_tape = keras.optimizers.SGD(0.01)

    @tf.function
    def step_tape() -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(Y, m_tape(X, training=True))
        g = hvd.DistributedGradientTape(tape).gradient(loss, m_tape.trainable_variables)
        opt_tape.apply_gradients(zip(g, m_tape.trainable_variables))
        return loss

    variants: dict[str, Callable[[], Any]] = {
        "hvdnb": step_hvd,
        "hvdnb_tape": step_tape,
    }
    if STRATEGY is not None:
        with STRATEGY.scope():
            m_ms = models["mwms"] = _model()
            opt_ms = keras.optimizers.SGD(0.01)
        loss_ms = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=keras.losses.Reduction.NONE
        )

        def replica() -> Any:
            with tf.GradientTape() as tape:
                per = loss_ms(Y, m_ms(X, training=True))
                loss = tf.reduce_mean(per) / N  # the strategy sums the replicas' gradients
            g = tape.gradient(loss, m_ms.trainable_variables)
            opt_ms.apply_gradients(zip(g, m_ms.trainable_variables))
            return loss

        @tf.function
        def step_ms() -> Any:
            return STRATEGY.run(replica)

        variants["mwms"] = step_ms
    variants["hand_mpi"] = plain(hand_sync)
    variants["no_comm"] = plain(None)
    return variants, models


def _allreduces(numel: int) -> dict[str, Callable[[], Any]]:
    x = tf.ones([numel])
    a = np.ones(numel, np.float32)
    out = np.empty_like(a)
    name = f"bench.{numel}"

    @tf.function
    def hvd_fn() -> Any:
        return hvd.allreduce(x, op=hvd.Sum, name=name + ".fn")

    @tf.function
    def floor_fn() -> Any:  # what calling any tf.function costs on this box
        return x + 0.0

    calls: dict[str, Callable[[], Any]] = {
        "hvdnb eager": lambda: hvd.allreduce(x, op=hvd.Sum, name=name),
        "hvdnb tf.function": hvd_fn,
        "empty tf.function (x + 0)": floor_fn,
    }
    if STRATEGY is not None:

        @tf.function
        def tf_fn() -> Any:
            ctx = tf.distribute.get_replica_context
            return STRATEGY.run(lambda: ctx().all_reduce(tf.distribute.ReduceOp.SUM, x))

        calls["TF collective (MWMS) tf.function"] = tf_fn
    calls["mpi4py Allreduce (numpy)"] = lambda: COMM.Allreduce(a, out, MPI.SUM)
    return calls


def _interleaved(fns: dict[str, Callable[[], Any]], blocks: int, per: int) -> dict[str, float]:
    """Median over blocks of the slower rank's mean seconds per call, per variant."""
    for f in fns.values():  # trace and warm up
        for _ in range(3):
            f()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    keys = list(fns)
    for b in range(blocks):
        for k in keys if b % 2 == 0 else keys[::-1]:  # swap the order every other block
            f = fns[k]
            COMM.Barrier()
            t0 = time.perf_counter()
            for _ in range(per):
                f()
            samples[k].append(COMM.allreduce((time.perf_counter() - t0) / per, op=MPI.MAX))
    return {k: statistics.median(v) for k, v in samples.items()}


def _drift(models: dict[str, Any], a: str, b: str) -> float | None:
    if a not in models or b not in models:
        return None
    wa = np.concatenate([w.numpy().reshape(-1) for w in models[a].trainable_variables])
    wb = np.concatenate([w.numpy().reshape(-1) for w in models[b].trainable_variables])
    return float(np.abs(wa - wb).max())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer blocks (smoke test)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "tf.json"))
    args = ap.parse_args()
    hvd.init()
    blocks, per = (4, 5) if args.quick else (12, 20)
    variants, models = _steps(args.batch)
    step_s = _interleaved(variants, blocks, per)
    drift = {
        "hvdnb vs hand_mpi": _drift(models, "hvdnb", "hand_mpi"),
        "hvdnb vs mwms": _drift(models, "hvdnb", "mwms"),
    }
    grad_numel = sum(int(np.prod(v.shape)) for v in models["hvdnb"].trainable_variables)
    calls_s = {}
    for numel in (1024, grad_numel):
        calls_s[numel] = _interleaved(_allreduces(numel), blocks, per * 5)
    if RANK != 0:
        return
    print(
        f"MLP 784-512-512-10 in tf-keras {keras.__version__ if hasattr(keras, '__version__') else ''}"
        f" (TF {tf.__version__}), batch {args.batch}/rank, {N} ranks, CPU, 1 intra-op "
        f"thread/rank, median of {blocks} interleaved blocks x {per} steps"
    )
    base = step_s.get("mwms")
    print(f"{'variant':>12} | {'ms/step':>8} | {'vs MWMS':>7}")
    for k, v in step_s.items():
        ratio = f"{v / base:6.2f}x" if base else "    n/a"
        print(f"{k:>12} | {v * 1e3:8.2f} | {ratio}")
    if MWMS_ERROR:
        print(f"mwms n/a: {MWMS_ERROR}")
    print(
        "max |weight difference| after training: "
        + ", ".join(f"{k}: {'n/a' if v is None else f'{v:.1e}'}" for k, v in drift.items())
    )
    for numel, res in calls_s.items():
        print(f"allreduce of {numel} float32 ({numel * 4 / 1e6:.3f} MB), Sum, per call:")
        for k, v in res.items():
            print(f"  {k:>34} | {v * 1e6:10.1f} us")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "ranks": N,
                "device": "CPU",
                "tensorflow": tf.__version__,
                "batch_per_rank": args.batch,
                "blocks": blocks,
                "steps": per,
                "step_ms": {k: v * 1e3 for k, v in step_s.items()},
                "mwms_error": MWMS_ERROR or None,
                "weight_drift": drift,
                "allreduce_us": {
                    str(n): {k: v * 1e6 for k, v in r.items()} for n, r in calls_s.items()
                },
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# The GPU-node checks of the benches and the gpu-marked tests, in one go, on one machine.
#
#   PY=.venv/bin/python OUT=/tmp/gpu BEFORE=/path/to/older/tree bench/gpu_node.sh
#
# PY: a python with hvdnb's dependencies (mpich's mpiexec beside it) and a CUDA torch.
# BEFORE (optional): an older checkout; each bench then runs before / after / before / after
# on the same warm machine, so their ratios can be compared. Writes OUT/log.txt and the
# benches' JSON under OUT/results/. Each step has its own time limit and a failed step does
# not stop the next.
set -u
PY=${PY:-python3}
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac  # absolute, links kept
OUT=${OUT:-/tmp/gpu-node}
HERE=$(cd "$(dirname "$0")/.." && pwd)
MPIEXEC=$(dirname "$PY")/mpiexec
RES=$OUT/results
mkdir -p "$RES"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1

step() {  # step LIMIT_S NAME command...
  local limit=$1 name=$2
  shift 2
  echo "=== $name ($(date +%T))"
  timeout -k 5 "$limit" "$@" 2>&1 | grep -v -E "^\s*$|UserWarning|warnings.warn"
  echo "=== $name: exit ${PIPESTATUS[0]}"
}

trees() {  # the trees to run a bench in, in order
  if [ -n "${BEFORE:-}" ]; then echo "$BEFORE $HERE $BEFORE $HERE"; else echo "$HERE"; fi
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$PY" -c "import torch, mpi4py; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"

k=0
for tree in $(trees); do  # per-call CUDA cost, 1 rank: hvdnb vs torch.distributed (NCCL)
  k=$((k + 1))
  tag=$([ "$tree" = "$HERE" ] && echo after || echo before)
  (cd "$tree" && step 120 "allreduce --cuda ($tag $k)" env PYTHONPATH="$tree" \
    "$MPIEXEC" -n 1 "$PY" "$HERE/bench/bench_allreduce.py" --cuda --max-bytes 262144 \
    --out "$RES/allreduce-cuda-$tag-$k.json")
done
k=0
for tree in $(trees); do  # a small model's step: DistributedOptimizer vs DDP (NCCL)
  k=$((k + 1))
  tag=$([ "$tree" = "$HERE" ] && echo after || echo before)
  (cd "$tree" && step 180 "mlp --cuda ($tag $k)" env PYTHONPATH="$tree" \
    "$MPIEXEC" -n 1 "$PY" "$HERE/bench/bench_mlp.py" --cuda --out "$RES/mlp-cuda-$tag-$k.json")
done

(cd "$HERE" && step 300 "pytest -m gpu" env PYTHONPATH="$HERE" "$PY" -m pytest -q -p no:cacheprovider \
  -m gpu tests/gpu tests/unit/test_nvtx.py -o addopts="-ra" -s)

# every notebook where users stand on a one-GPU node: 1 rank (NCCL, the default there) and
# 2 ranks sharing the GPU (gloo); a table of notebook x ranks -> exit code and seconds
for n in 1 2; do
  for nb in "$HERE"/notebooks/[0-9][0-9]-*.ipynb; do
    name=$(basename "$nb" .ipynb)
    t0=$(date +%s)
    (cd "$HERE" && PATH="$(dirname "$PY"):$PATH" timeout -k 5 240 "$PY" -m hvdnb.notebook.headless.cli run "$nb" \
      -n "$n" $([ "$n" -gt 1 ] && echo --oversubscribe) -o "$OUT/$name-$n.ipynb" >"$OUT/$name-$n.log" 2>&1)
    rc=$?
    echo "notebook $name at $n rank(s): exit $rc in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/notebooks.txt"
    [ $rc = 0 ] || tail -n 5 "$OUT/$name-$n.log"
  done
done

# a cell that trains on the GPU, in the real kernel (started from the kernelspec, driven over
# jupyter_client as JupyterLab does), with %%px on the same engines as the anchor
(cd "$HERE" && step 180 "real kernel trains on the GPU" env PYTHONPATH="$HERE" "$PY" - <<'PYEOF'
import time
from hvdnb.notebook.headless.runner import Kernel
with Kernel({"HVDNB_PANEL": "inline"}) as k:
    print(k.run("%load_ext hvdnb\n%dist start -n 1").text.strip().splitlines()[0])
    cell = ("%%distributed\nimport torch, hvdnb, hvdnb.torch as hvd\nhvd.init()\n"
            "m = torch.nn.Linear(512, 512).cuda()\n"
            "opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01), named_parameters=m.named_parameters())\n"
            "for s in range(300):\n    loss = m(torch.randn(64, 512, device='cuda')).pow(2).mean()\n"
            "    opt.zero_grad(); loss.backward(); opt.step(); hvdnb.log(s, loss)\n"
            "print('trained on', next(m.parameters()).device, 'loss', round(loss.item(), 4))")
    r = k.run(cell)
    print(f"train cell {r.seconds:.2f} s: {r.text.strip()} error={r.error}")
    for code in ("%%distributed\npass", "%%px\npass"):
        times = [k.run(code).seconds for _ in range(5)]
        print(f"{code.splitlines()[0]} no-op: median {1e3 * sorted(times)[2]:.1f} ms")
    k.run("%dist stop")
PYEOF
)

for n in ${NS:-4 8 16}; do  # CPU ranks on this machine's cores, small sizes (no GPU: gloo + MPI)
  for tree in $(trees | cut -d' ' -f1-2); do
    tag=$([ "$tree" = "$HERE" ] && echo after || echo before)
    (cd "$tree" && step 120 "allreduce cpu $n ranks ($tag)" \
      env PYTHONPATH="$tree" CUDA_VISIBLE_DEVICES= "$MPIEXEC" -n "$n" "$PY" "$HERE/bench/bench_allreduce.py" --no-gloo --max-bytes 65536 \
      --out "$RES/allreduce-$n-$tag.json")
  done
done
echo "=== done ($(date +%T))"

#!/usr/bin/env bash
# Direct kernel launches (numba_kernels/_cuda/launch.py) on a GPU, in one device call:
#   (1) benchmarks/launch_overhead.py: host us per launch, Numba's dispatcher against the
#       direct launch, and what viewing tensors costs;
#   (2) the check model at 2 ranks over staged MPI (tests/gpu/train_all.py --compare-launch):
#       the direct launch and the dispatcher interleaved, algorithm by algorithm (the losses
#       must be the same);
#   (3) a cProfile of both threads of rank 0 for qsgd (tests/gpu/profile_comm.py);
#   (4) pytest -m gpu on the kernel tests: every kernel byte-identical to its CPU twin.
# Run:  run(command="bash tests/gpu/launch_check.sh", carry=[".whl"], timeout_s=420)
# Everything lands in $OUT/launch_check.tar.gz (the device tool brings back 8 files at most).
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
W=/tmp/launch_check; rm -rf $W; mkdir -p $W
source tests/gpu/wheels_env.sh || exit 3
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
export PYTHONWARNINGS=ignore::RuntimeWarning BAGUA_MPI_CUDA_AWARE=0
pack() { [ -n "${OUT:-}" ] && tar -czf "$OUT/launch_check.tar.gz" -C $W . ; }
trap pack EXIT
timeout 60 python3 benchmarks/launch_overhead.py > $W/launch_overhead.md 2>&1
cat $W/launch_overhead.md
ALGOS=${ALGOS:-"gradient_allreduce qsgd bytegrad onebit_adam topk gtopk lgreco powersgd"}
timeout 170 mpiexec -n 2 python3 tests/gpu/train_all.py --mode staged --compare-launch \
    --only $ALGOS --out $W/train_launch.jsonl > $W/train_launch.log 2>&1
echo "training, direct and dispatcher interleaved: rc $?"
grep -E "OK|FAIL" $W/train_launch.log | cut -c1-120
pack
for a in qsgd; do
    timeout 90 mpiexec -n 2 python3 tests/gpu/profile_comm.py $W $a > $W/profile_$a.log 2>&1
    echo "profile $a: rc $?"; pack
done
timeout 100 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/kernels > $W/pytest.log 2>&1
echo "pytest -m gpu tests/kernels: rc $?"; tail -3 $W/pytest.log

#!/usr/bin/env bash
# The GPU figures and tests of docs/gpu.md, in two calls of a lent GPU machine (each well under
# its 10 minutes; the second right after the first, while the machine is warm):
#
#   bash bench/gpu_session.sh part1          # start-up check, the state transfer with CUDA
#                                            # state, the overhead and its candidates
#   bash bench/gpu_session.sh part2 [SECONDS] # a recovery in place beside the restart path,
#                                            # then the checkpoint stall, within SECONDS
#   bash bench/gpu_session.sh tests          # pytest -m gpu, 14 at a time (about 2 minutes)
#
# On the H200 of 2026-11-28 a launch of the GPT-2-small-sized runner took about 65 s: the
# overhead section holds about five launches in its 400 s.
#
# The machine's python3 holds torch with CUDA; the project's dependencies it lacks travel as
# wheels in .whl/ (docs/gpu.md names them; `bash bench/gpu_wheels.sh` makes them here, and the
# device tool carries them: carry [".whl"]). JSON and logs go to $OUT (default /tmp/gpu-out).
set -u
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
section() { echo "=== $1 $(date +%T)"; }

case ${1:-} in
part1)
    section env
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
    python3 - <<'EOF' || exit 4
import torch
from elastic_runner.compat import registry
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.nccl.version())
print("agent:", registry.check_torch("agent"))
print("worker:", registry.check_torch("worker"))
EOF
    section transfer
    timeout 80 python3 -m bench.state_transfer --device cuda:0 --world-sizes 2 4 --blocks 115 \
        --repeats 3 --json "$out/state_transfer_cuda.json"
    section overhead
    timeout 400 python3 -m bench.gpu --sections overhead --repeats 3 --steps 150 \
        --json "$out/gpu_overhead.json" 2>&1 | tee "$out/overhead.log" | grep -v "^\s*$"
    section done
    ;;
tests)
    section pytest
    timeout 150 python3 -m pytest -m gpu tests/test_gpu.py -n 14 -p no:cacheprovider -q \
        --timeout 140 --durations=0 --junitxml "$out/pytest_gpu.xml" > "$out/pytest.log" 2>&1
    echo "pytest rc=$?"
    grep -E "passed|failed|error|PASSED|FAILED|ERROR|s call" "$out/pytest.log" | tail -30
    section done
    ;;
part2)
    section recovery
    timeout "${2:-170}" python3 -m bench.gpu --sections recovery stall \
        --json "$out/gpu_recovery.json" 2>&1 | tail -12
    section done
    ;;
*)
    echo "usage: bash bench/gpu_session.sh part1|part2 [SECONDS]|tests" >&2
    exit 2
    ;;
esac

#!/usr/bin/env bash
# The wheels bench/gpu_session.sh installs on a lent GPU machine, which reaches no package
# registry: what its image lacked in the 2026-11-24 and 2026-11-28 sessions (docs/gpu.md), for
# its Python 3.12 on x86-64, into .whl/ (ignored by git; give the device tool carry [".whl"]).
#
#   bash bench/gpu_wheels.sh        # here, before the device session; about 5 MB
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl
mkdir .whl
# pydantic with the pydantic-core it pins, resolved for the device's interpreter
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "pydantic>=2.6" "dnspython>=1.13"
# python-etcd is published as a source archive only: a pure-Python wheel built here
python3 -m pip wheel -q --no-deps -w .whl "python-etcd>=0.4.5"
ls .whl

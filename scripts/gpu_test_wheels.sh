#!/usr/bin/env bash
# Downloads the test wheels the GPU machine lacks into .whl/ (kept out of git), for
# scripts/gpu_suite.sh, which installs them beside MLX's CUDA build with no network. The GPU
# machine runs Python 3.12 on x86_64 Linux; only pure-Python wheels and manylinux ones are
# taken, and no dependencies are resolved here (the list names every part the tests import:
# docs/testing-on-gpu.md, runs 20 and 21, says how each was found missing). About 13.5 MB,
# which with the tree and MLX's third part fills most of the 64 MiB a device call carries.
#
#   bash scripts/gpu_test_wheels.sh            # then carry [".device/c", ".whl"]
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=(
  pytest pytest-xdist execnet pluggy iniconfig packaging pygments
  mlx-vlm fastapi starlette uvicorn h11 click annotated-doc opentelemetry-api
  openai anthropic httpx httpcore httpx2 httpcore2 truststore anyio sniffio idna certifi
  jsonschema jsonschema-specifications referencing rpds-py attrs
  distro jiter tqdm typing-extensions annotated-types docstring-parser
  requests urllib3 charset-normalizer
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${wheels[@]}"
du -sh .whl

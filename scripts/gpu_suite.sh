#!/usr/bin/env bash
# Runs the test suite on the GPU machine (docs/testing-on-gpu.md). Source .device/c/setup.sh
# first, carry .device/c and .whl (the test wheels), then:
#   SUITE_TIMEOUT=540 bash scripts/gpu_suite.sh -o addopts="" -p xdist -n 15 -v -rfEs PART
# where PART is one line of `python scripts/gpu_suite_parts.py 3` (the whole suite no longer fits
# one ten-minute call on a fresh host; -v names each result as it lands)
# MLX goes into the interpreter's own site-packages (subprocess tests build their own
# environment), and the package is installed by that interpreter, so the `outrider` console
# script sits beside python3. No network: every wheel comes from the carried parts. The test
# wheels (pytest, pytest-xdist, fastapi, uvicorn, openai, anthropic, jsonschema, httpx and
# mlx-vlm with their dependencies) go into .whl with `bash scripts/gpu_test_wheels.sh`.
set -u
here="$(pwd)"
wheels=$(mktemp -d)
cat /root/outrider-stash/wheels.part_0 /root/outrider-stash/wheels.part_1 .device/c/wheels.part_2 \
  | tar xf - -C "$wheels"
# .whl: the test wheels carried with this call; /root/outrider-extra: wheels too large to
# carry beside MLX's third part (ruff, schemathesis and its parts), stashed there by earlier
# calls on the same warm machine (docs/testing-on-gpu.md)
for w in "$here"/.whl/*.whl /root/outrider-extra/*.whl; do  # one copy of each (pip refuses two)
  [ -e "$w" ] || continue
  [ -e "$wheels/$(basename "$w")" ] || cp "$w" "$wheels"/
done
# PYTHONPATH unset: pip counts what setup.sh's folder holds as installed and would skip it
env -u PYTHONPATH python3 -m pip install -q --no-index --no-deps --no-compile "$wheels"/*.whl || exit 3
if ! env -u PYTHONPATH python3 -m pip install -q --no-index --no-deps --no-build-isolation -e "$here"; then
  echo "gpu_suite.sh: an editable install failed; writing the console script by hand" >&2
  bin="$(dirname "$(python3 -c 'import sys; print(sys.executable)')")"
  printf '#!%s\nimport sys\nsys.path.insert(0, %s)\nfrom outrider.__main__ import run\nrun()\n' \
    "$(python3 -c 'import sys; print(sys.executable)')" "'$here'" > "$bin/outrider"
  chmod +x "$bin/outrider"
fi
rm -rf "$wheels"
# what a subprocess test's child sees: the interpreter's own site-packages, no PYTHONPATH
env -u PYTHONPATH python3 -c "import mlx.core as mx, mlx_lm, outrider; print('mlx', mx.__version__, mx.default_device(), 'outrider from', outrider.__file__)" || exit 3
# what the tests import beyond the carried wheels: a missing one fails its tests by import, so
# name it before they run (run 19's five failures came back without their reasons)
env -u PYTHONPATH python3 - <<'PY'
import importlib.util
optional = ("mlx_vlm", "fastapi", "uvicorn", "openai", "anthropic", "requests", "jsonschema")
missing = [m for m in optional if importlib.util.find_spec(m) is None]
print("gpu_suite.sh: not installed here, their tests fail by import:", ", ".join(missing) or "none")
PY
# SIGINT at the limit: pytest stops and still prints its summary, failures' reasons included.
# The whole output also goes to $OUT/suite.txt, which a device call hands back as a file: the
# call's reply keeps only the last 12,000 characters (run 21's lost 6 of its 19 failures' names)
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  PYTHONUNBUFFERED=1 timeout --signal=INT --kill-after=20 "${SUITE_TIMEOUT:-540}" \
    python3 -m pytest "$@" 2>&1 \
    | tee "$OUT/suite.txt"
  exit "${PIPESTATUS[0]}"
fi
timeout --signal=INT --kill-after=20 "${SUITE_TIMEOUT:-540}" python3 -m pytest "$@"

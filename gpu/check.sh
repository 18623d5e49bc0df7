#!/usr/bin/env bash
# The GPU check in one call (docs/gpu.md): install the wheels carried in .whl/ (what the GPU
# machine's image lacks; `python -m gpu.check wheels` makes them), then run every step of
# gpu/check.py, stopping by DEADLINE_S seconds and keeping what it measured.
#   gpu/check.sh OUT [DEADLINE_S] [--shrink]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu/check.sh OUT [DEADLINE_S] [--shrink]}
deadline=${2:-530}
python=${PYTHON:-python3}
mkdir -p "$out"
wheels=${WHEELS:-.whl}
if compgen -G "$wheels/*.whl" >/dev/null; then
    site=$(mktemp -d)
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl \
        || { echo "error: the carried wheels did not install ($wheels)"; exit 2; }
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
"$python" -m gpu.check run --out "$out" --deadline-s "$deadline" "${@:3}" 2>&1 | tee "$out/log.txt"

#!/usr/bin/env bash
# GPU check, one command on a CUDA machine with no network (at most 9 minutes): bash scripts/gpu_check.sh
#
#   bash scripts/gpu_check.sh --download    # beforehand, where PyPI is reachable: the wheels of
#                                           # scripts/gpu_wheels.txt into .gpu-wheels/ (git-ignored)
#   bash scripts/gpu_check.sh [ARGS]        # on the GPU machine, from the repository root (with
#                                           # .gpu-wheels/ copied along): installs those wheels
#                                           # offline, then runs scripts/gpu_check.py [ARGS]
#
# The machine is expected to have Python 3.12 with a CUDA build of torch, transformers, triton
# and accelerate. The wheels go to a folder of their own ($GPU_CHECK_SITE) put first on
# PYTHONPATH, with --no-deps: nothing installed on the machine is touched. The project itself
# is not installed; scripts/gpu_check.py imports it from this checkout. Exit code: that of
# gpu_check.py (0 = every stage passed), 124 when the time limit stopped it, 3 when a wheel is
# missing. docs/gpu-check.md says what it runs and prints. Not part of CI.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=${GPU_CHECK_WHEELS:-.gpu-wheels}
SITE=${GPU_CHECK_SITE:-/tmp/qad-gpu-check/site}
LIMIT_S=${GPU_CHECK_LIMIT_S:-540}
PYTHON=${PYTHON:-python3}
LIST=scripts/gpu_wheels.txt
# The name==version lines of the list: `requirements 0` those with wheels on PyPI, `requirements 1`
# those marked "# sdist" (pure Python, no wheel on PyPI: built with pip wheel).
requirements() {
    awk -v want="$1" '/^[[:space:]]*(#|$)/ {next} {sdist = ($0 ~ /#[[:space:]]*sdist/)} sdist == want {print $1}' "$LIST"
}

if [[ "${1:-}" == "--download" ]]; then
    mkdir -p "$WHEELS"
    platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
               --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
    requirements 0 | xargs "$PYTHON" -m pip download --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp "${platforms[@]}" -d "$WHEELS"
    requirements 1 | xargs "$PYTHON" -m pip wheel --no-deps -w "$WHEELS"
    du -ch "$WHEELS"/*.whl | tail -1
    exit 0
fi

started=$SECONDS
# every listed wheel is there, once (GPU_CHECK_MACHINE_TRANSFORMERS=1: the machine's transformers)
wheels=()
missing=0
while read -r req; do
    name=$(echo "${req%%==*}" | tr '.-' '__')
    [[ "${GPU_CHECK_MACHINE_TRANSFORMERS:-0}" == 1 && "$name" == transformers ]] && continue
    found=$(find "$WHEELS" -maxdepth 1 -iname "${name}-${req#*==}-*.whl" 2>/dev/null)
    if [[ $(echo -n "$found" | grep -c .) -ne 1 ]]; then
        echo "gpu_check: $req: no single wheel for it in $WHEELS (run: bash scripts/gpu_check.sh --download)" >&2
        missing=1
    fi
    wheels+=("$found")
done < <(requirements 0; requirements 1)
[[ "$missing" -eq 0 ]] || exit 3

echo "gpu_check: installing ${#wheels[@]} wheels into $SITE (offline)"
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export MAX_JOBS=${MAX_JOBS:-$(nproc)}  # Model Optimizer builds its CUDA extensions on first use
echo "gpu_check: wheels installed in $((SECONDS - started)) s; running scripts/gpu_check.py (limit ${LIMIT_S} s in all)"

left=$((LIMIT_S - (SECONDS - started)))
(( left > 0 )) || { echo "gpu_check: the ${LIMIT_S} s limit was spent installing the wheels" >&2; exit 124; }
# SIGINT first, so that gpu_check.py prints its summary; SIGKILL 15 s later.
set +e
timeout -s INT -k 15 "$left" "$PYTHON" scripts/gpu_check.py "$@"
code=$?
set -e
echo "gpu_check: exit $code after $((SECONDS - started)) s"
exit "$code"

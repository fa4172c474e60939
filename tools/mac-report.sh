#!/usr/bin/env bash
# One command for a shareable report of dflash-mlx on this machine (meant for a Mac; it runs on
# Linux too, on the CPU): from a checkout with the package installed (bash tools/install-dev.sh
# for the kernels' tests), run
#
#     bash tools/mac-report.sh                  # writes dflash-mlx-report-DATE/ and DATE.tar.gz
#     bash tools/mac-report.sh --quick          # small settings: minutes less, fewer digits
#     bash tools/mac-report.sh --model M --draft D --draft-quant w4 --blocks "2 4 8" --out DIR
#
# and attach the .tar.gz to an issue. Each part's output goes to its own file; summary.md lists
# every part with its command, exit status and seconds, and the versions. A part that fails does
# not stop the others (its status says so); the script exits 1 if any failed, after writing the
# archive. The parts:
#   machine        OS, chip, Python, MLX, mlx-lm, this checkout's commit
#   doctor         `dflash-mlx doctor` (this machine, Metal, the kernels' self-checks), and with the
#                  pair: memory, acceptance probe, and on a Mac `--tune` (stock against our kernels
#                  for every quantized matmul shape of the pair; the demo with a w4 draft)
#   kernel-checks  the Apple-GPU tests (pytest -k apple_gpu: the kernels on this GPU for every form,
#                  dtype and M = 1..16 against their references, verify rows bit for bit their
#                  decode steps, the lossless pairs through the real kernels); skipped off a Mac
#   cycle-costs    examples/cycle_costs.py for each block size: a plain step, a cycle and its parts
#   compiled       examples/compiled_layer_cost.py: the demo target's kernel layers plain against
#                  compiled once their kernels are decided (on a Mac the real kernels, evaluated)
#   bench          `dflash-mlx bench` of the pair against the target alone and mlx-lm (JSON, PNG,
#                  the table, and each greedy divergence with the target's top-2 gap)
# Nothing here sends anything anywhere; the report holds no path outside the checkout but $OUT's.
# shellcheck disable=SC2317  # machine and kernel_checks are called through part
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

model=demo draft="" draft_quant="" blocks="" out="" quick=0
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model="$2"; shift 2 ;;
    --draft) draft="$2"; shift 2 ;;
    --draft-quant) draft_quant="$2"; shift 2 ;;
    --blocks) blocks="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --quick) quick=1; shift ;;
    -h|--help) sed -n '2,/^# Nothing here/p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "mac-report: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

python=${PYTHON:-python}
command -v "$python" > /dev/null || python=python3
if command -v dflash-mlx > /dev/null; then cli=(dflash-mlx); else cli=("$python" -m dflash_mlx.cli); fi
stamp=$(date -u +%Y%m%d-%H%M%S)
out=${out:-dflash-mlx-report-$stamp}
mkdir -p "$out"
summary="$out/summary.md"
failed=0

# Demo-sized defaults; the demo draft's block size is 4.
if [ -z "$blocks" ]; then
  if [ "$model" = demo ]; then blocks="2 3 4"; else blocks="2 4 8 16"; fi
fi
if [ "$quick" = 1 ]; then
  contexts=256 cycle_repeats=2 bench_args=(--repeats 1 --max-tokens 32 --suite edit)
else
  contexts=512,2k cycle_repeats=7 bench_args=()
fi
pair=(--model "$model")
[ -n "$draft" ] && pair+=(--draft "$draft")
doctor_pair=("${pair[@]}")
if [ -n "$draft_quant" ]; then
  pair+=(--draft-quant "$draft_quant")
  doctor_pair+=(--draft-quant "$draft_quant")
elif [ "$model" = demo ]; then
  doctor_pair+=(--draft-quant w4)  # the demo is unquantized: a w4 draft gives the kernels layers to run
fi
metal=$("$python" -c "import mlx.core as mx; print(int(mx.metal.is_available()))" 2>/dev/null || echo 0)

# part NAME FILE COMMAND...: runs COMMAND, its output to $out/FILE (stderr too, but beside a .json), a line in
# summary.md.
part() {
  local name=$1 file=$2
  shift 2
  local start end status
  echo "== $name: $*"
  start=$(date +%s)
  if [[ $file == *.json ]]; then  # JSON alone in its file; warnings and progress beside it
    "$@" > "$out/$file" 2> "$out/${file%.json}.stderr.txt"
  else
    "$@" > "$out/$file" 2>&1
  fi
  status=$?
  end=$(date +%s)
  if [ "$status" -ne 0 ]; then failed=1; fi
  # shellcheck disable=SC2016  # the backquotes are Markdown's
  printf '| %s | `%s` | %s | %s | %s |\n' "$name" "$*" "$status" "$((end - start))" "$file" >> "$summary"
  echo "   exit $status, $((end - start)) s -> $out/$file"
}

machine() {
  echo "date (UTC): $(date -u '+%Y-%m-%d %H:%M:%S')"
  uname -srm
  if command -v sw_vers > /dev/null; then sw_vers; sysctl -n machdep.cpu.brand_string hw.memsize 2>/dev/null; fi
  "$python" - <<'EOF'
import platform
import importlib.metadata as metadata

import mlx.core as mx

print("python", platform.python_version())
for name in ("mlx", "mlx-lm", "dflash-mlx"):
    try:
        print(name, metadata.version(name))
    except metadata.PackageNotFoundError:
        print(name, "not installed")
print("mlx default device:", mx.default_device(), "| Metal available:", mx.metal.is_available())
if mx.metal.is_available():
    info = mx.metal.device_info() if hasattr(mx.metal, "device_info") else mx.device_info()
    print("Metal device:", {k: info[k] for k in sorted(info)})
EOF
  git log -1 --format='checkout: %H %cd' 2>/dev/null || true
  git status --short 2>/dev/null | head -20 | sed 's/^/  changed: /'
}

kernel_checks() {
  if ! "$python" -c "import pytest" 2> /dev/null; then
    echo "pytest is not installed: bash tools/install-dev.sh installs what the kernels' tests need"
    return 1
  fi
  [ "$metal" = 1 ] || echo "no Metal GPU here: the Apple-GPU tests are skipped (doctor's self-checks say the same)"
  # The same files as .github/workflows/macos-metal.yml's APPLE_GPU_TESTS (a test keeps them equal).
  "$python" -m pytest -v -rs -p no:cacheprovider tests/test_mac_path.py tests/test_kernels.py \
    tests/test_quantized_tile.py tests/test_doctor.py tests/test_splash.py tests/test_compiled_kernels.py \
    -k apple_gpu --junitxml="$out/kernel-checks.xml"
}

{
  echo "# dflash-mlx report $stamp"
  echo
  echo "Pair: ${pair[*]}; blocks: $blocks; $([ "$quick" = 1 ] && echo quick settings || echo full settings)."
  echo "Metal: $([ "$metal" = 1 ] && echo yes || echo 'no (MLX on the CPU: timings are a proxy for overhead, not a Mac)')."
  echo
  echo "| part | command | exit | seconds | output |"
  echo "|---|---|---:|---:|---|"
} > "$summary"

part machine machine.txt machine
part doctor doctor.txt "${cli[@]}" doctor
doctor_flags=(--json)
[ "$metal" = 1 ] && doctor_flags+=(--tune)
[ "$quick" = 1 ] && doctor_flags+=(--probe-tokens 8)
part "doctor (pair)" doctor-pair.json "${cli[@]}" doctor "${doctor_pair[@]}" "${doctor_flags[@]}"
part kernel-checks kernel-checks.txt kernel_checks
for block in $blocks; do
  part "cycle costs, block $block" "cycle-costs-b$block.txt" "$python" examples/cycle_costs.py "${pair[@]}" \
    --contexts "$contexts" --block "$block" --repeats "$cycle_repeats"
done
compiled_args=(--calls 100 --repeats 3)
[ "$quick" = 1 ] && compiled_args=(--calls 20 --repeats 1)
[ "$metal" = 1 ] && compiled_args+=(--kernels metal --evaluate)
part "compiled layers" compiled-layers.txt "$python" examples/compiled_layer_cost.py "${compiled_args[@]}"
plot=()
"$python" -c "import matplotlib" 2> /dev/null && plot=(--plot "$out/bench.png")
part bench bench.txt "${cli[@]}" bench "${pair[@]}" "${bench_args[@]}" --out "$out/bench.json" "${plot[@]}"

{
  echo
  if [ "$failed" = 0 ]; then echo "Every part exited 0."; else echo "Some part exited non-zero: its output file says why."; fi
  echo
  echo "## Machine and versions"
  echo
  echo '```'
  cat "$out/machine.txt"
  echo '```'
} >> "$summary"
tar -czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
echo
cat "$summary"
echo
echo "Report: $out/ and $out.tar.gz (attach the .tar.gz to an issue)"
exit "$failed"

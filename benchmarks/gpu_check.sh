#!/usr/bin/env bash
# The prepared device check for a lent GPU machine: one run, results under $OUT, and an exit status that
# says whether every step met its expectation (0) or not (1).
#
# It uses the machine's own torch (nothing is installed: the plugin runs from this source tree through
# PYTHONPATH and -p, its built-in scenarios loaded from the package itself), records a bf16 FSDP2 reference with
# triage's equivalence and float64 oracle in the same session (the recording is judged by that oracle too, so it
# runs once), compares a second run with it bit for bit (run-to-run determinism), forces another SDPA backend and
# a host fallback (the kernel inventory must name both), runs the collective sweep once per NCCL protocol, injects
# a bf16 AVG tail fault and runs the sweep benchmark. Budget: 6 minutes on one H100 or H200 (50 training steps),
# leaving a 15-minute lease room for the machine's start, the transfers and one rerun; the run prints its
# estimate of that time from the steps it launches (gpu_check_expect.py budget), the dry run for 1 and 8 GPUs.
#
# Dry run (GPU_CHECK_DRY_RUN=1 or --dry-run): the same steps on 2 gloo CPU ranks with 4 steps and narrow
# collective selections, so a wrong path or option fails in CI rather than on the one GPU run a task may get.
# Expectations differ from the GPU's only where the CPU really behaves otherwise; each says why.
set -uo pipefail
DRY=${GPU_CHECK_DRY_RUN:-0}
[[ ${1:-} == --dry-run ]] && DRY=1
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
# References, artifacts and step logs live outside $OUT: the device returns at most 8 files from it, 2 folders deep.
WORK=$(mktemp -d)
REFS=$WORK/refs
PY=${PYTHON:-python3}
# Only this plugin, from this tree: neither an installed copy nor the machine's other pytest plugins.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1

# What the GPU run takes: its training steps, noise replicas and seconds. 50 steps and one replica, not 300 and 3:
# with every launch counted (gpu_check_expect.py budget) more would not fit 360 s on one GPU; the machinery is the
# same, and the references it records say so in their config (steps) and envelope (replicas).
GPU_STEPS=50 GPU_REPLICAS=1 GPU_BUDGET=${GPU_CHECK_BUDGET:-360}
if (( DRY )); then
    # One noise replica, not 3: the replica machinery still runs; the other two only cost CPU time.
    DEVICE=cpu STEPS=4 REPLICAS=1 BUDGET=${GPU_CHECK_BUDGET:-600}
    SWEEP=(-k "collectives and all_reduce and sum and fp32" --gpuregress-collectives-max-bytes=4KiB)
    FAULT_MAX=(--gpuregress-collectives-max-bytes=4KiB)
    BENCH=(--device cpu --max-bytes 4KiB --repeats 1)
else
    # 8 minutes: a device command may run 10, and the table must be printed before that.
    DEVICE=cuda STEPS=$GPU_STEPS REPLICAS=$GPU_REPLICAS BUDGET=$GPU_BUDGET
    # Three protocols x the whole sweep: 64 MiB keeps it in budget; the benchmark step below goes to 256 MiB.
    SWEEP=(-k collectives --gpuregress-collectives-max-bytes=64MiB)
    FAULT_MAX=()
    BENCH=(--device cuda)
fi
P=("$PY" -m pytest -p pytest_gpuregress.plugin -p no:cacheprovider -q -W default --gpuregress
   "--gpuregress-device=$DEVICE" --gpuregress-timeout=240 "--gpuregress-steps=$STEPS"
   "--gpuregress-reference-dir=$REFS" "--gpuregress-artifacts=$WORK/artifacts")
CLI='import sys; from pytest_gpuregress.cli import main; sys.exit(main(sys.argv[1:]))'
# Every expectation below comes from benchmarks/gpu_check_expect.py, whose CPU tests match each GPU one against
# GPU-shaped output; MODE picks the column (gpu-w1 once the key says one GPU).
EXPECT=("$PY" benchmarks/gpu_check_expect.py)
if (( DRY )); then MODE=dry; else MODE=gpu; fi
expect() { "${EXPECT[@]}" text "$1" "$MODE"; }

NAMES=() EXPECTED=() OUTCOMES=() SECS=() VERDICTS=()
# step NAME EXPECT REGEX -- COMMAND...: EXPECT is pass (exit 0), fail (1) or usage (4); REGEX, if any, must
# appear in the output, so a pass or failure for another reason does not count. A step gets what is left of
# BUDGET; once it is spent the remaining steps are listed as not run, which differs from any expectation.
step() {
    local name=$1 expect=$2 regex=$3 log=$WORK/logs/$1.log start=$SECONDS left=$((BUDGET - SECONDS)) rc got
    shift 4
    mkdir -p "$WORK/logs"
    echo "+ [$name] $*" | tee -a "$OUT/log"
    if (( left < 10 )); then
        echo "not run: the ${BUDGET}s budget is spent" >"$log"
        rc=-1
    else
        timeout "$left" "$@" >"$log" 2>&1
        rc=$?
    fi
    tail -n 40 "$log" | tee -a "$OUT/log"
    case $rc in 0) got=pass ;; 1) got=fail ;; 4) got=usage ;; 124) got=timeout ;; -1) got="not run" ;; *) got="exit $rc" ;; esac
    [[ -n $regex && $rc != -1 ]] && ! grep -Eq -- "$regex" "$log" && got="$got, text missing"
    NAMES+=("$name") EXPECTED+=("$expect${regex:+ /$regex/}") OUTCOMES+=("$got") SECS+=($((SECONDS - start)))
    if [[ $got == "$expect" ]]; then VERDICTS+=(ok); else VERDICTS+=(DIFFERS); fi
}

# The stack fingerprint; the device kind proves torch sees what this mode expects.
step env pass "$(expect env)" -- "$PY" -c "$CLI" env --json --device "$DEVICE"
cp "$WORK/logs/env.log" "$OUT/fingerprint.json"
# The key the code files fsdp references under (stack/platforms.py), not a spelling of our own.
step platform-key pass "$(expect platform-key)" -- "$PY" -c '
import sys
from pytest_gpuregress.scenarios import registry
from pytest_gpuregress.scenarios.base import Setup
from pytest_gpuregress.stack.platforms import resolve_platform
p = resolve_platform(sys.argv[1])
sc = registry()["fsdp"]
print(p.key(sc.platform_tag(sc.default_config(Setup(p.device_kind, p.backend, p.world_size, steps=int(sys.argv[2]))))))
' "$DEVICE" "$STEPS"
KEY=$(tail -n 1 "$WORK/logs/platform-key.log")
RECORD=$REFS/fsdp/$KEY/record.json
[[ $MODE == gpu && $KEY == *-w1-* ]] && MODE=gpu-w1
# The GPU run's time, estimated from the steps below and the per-launch costs gpu_check_expect.py states: for one
# GPU and for eight in the dry run, for this machine's GPUs on it.
if (( DRY )); then GPUS=(1 8); elif [[ $KEY =~ -w([0-9]+)- ]]; then GPUS=("${BASH_REMATCH[1]}"); else GPUS=(1); fi
for gpus in "${GPUS[@]}"; do
    "${EXPECT[@]}" budget "$GPU_STEPS" "$GPU_REPLICAS" "$gpus" "$GPU_BUDGET" | tee -a "$OUT/log" "$WORK/budget.txt"
done

# The fsdp case alone: not its triage, resume or (on the CPU of the dry run) bf16-lane cases.
FSDP_CASE="fsdp and not triage and not resume and not bf16"
# Recorded with triage's cases beside it: N ranks against one (skipped at one rank: it needs 2+), and one rank
# against float64 (bf16's bound on GPUs). The recording is judged by the same float64 oracle launch, so the session
# runs it once.
step record pass "$(expect record)" -- "${P[@]}" -k "fsdp and not resume and not bf16" --gpuregress-record \
    "--gpuregress-replicas=$REPLICAS"
step reference-at-key pass '' -- test -f "$RECORD"
# Run-to-run determinism: a second run on the same stack compares in the exact lane, bit for bit.
step compare pass "$(expect compare)" -- "${P[@]}" -k "$FSDP_CASE"
# The kernel inventory on the device: a forced SDPA backend, one the clean run does not use, must fail the run
# as a kernel change, and the failed run's kept record must show SDPA dispatched to it (read from the structure:
# on a GPU the report lists device kernels first and only the first changed ops).
step sdpa-backend fail "$(expect sdpa-backend)" -- "${P[@]}" -k "$FSDP_CASE" \
    "--gpuregress-inject=sdpa_backend:backend=$("${EXPECT[@]}" sdpa-backend "$MODE")" --gpuregress-lane=tolerant \
    --gpuregress-kernel-changes=fail
step sdpa-forced pass '' -- "${EXPECT[@]}" sdpa-forced "$MODE" "$WORK/artifacts/runs/fsdp/$KEY/record.json"
# A real host fallback on a GPU; on the CPU the GPU is emulated by a device tag, with the same report. 4 steps
# recorded into a folder of their own: on the GPU model silu on the host costs seconds a step, and a recording
# that fails its own checks names them without needing a reference.
step host-op fail "$(expect host-op)" -- "${P[@]}" -k "$FSDP_CASE" --gpuregress-inject=host_op:op=silu \
    --gpuregress-record --gpuregress-replicas=0 --gpuregress-steps=4 "--gpuregress-reference-dir=$WORK/refs-host-op"
# What the clean reference's inventory holds (gpu_check_expect.py says why each mode differs).
step inventory pass '' -- "${EXPECT[@]}" inventory "$MODE" "$RECORD"
# NCCL protocol pinning; gloo has no protocols, so on the CPU the sweep runs once and says so.
# At one rank every collective case needs peers, so each is skipped with its reason.
step protocols pass "$(expect protocols)" -- "${P[@]}" "${SWEEP[@]}" --gpuregress-nccl-protos=LL,LL128,Simple
# An injected bf16 AVG tail fault. A one-rank collective moves no data, so on one GPU the fault cannot fire and
# the run refuses it as a usage error; with 2+ ranks (the CPU's 2 gloo ranks too) it must be caught.
if [[ $MODE == gpu-w1 ]]; then FAULT=(usage "$(expect collective-fault)"); else FAULT=(fail "$(expect collective-fault)"); fi
step collective-fault "${FAULT[@]}" -- "${P[@]}" -k "all_reduce and avg and bf16" "${FAULT_MAX[@]}" \
    "--gpuregress-inject=collective:op=all_reduce,dtype=bfloat16,reduce_op=avg,mode=zero_tail,count=8"
if [[ $MODE == gpu-w1 ]]; then  # a one-rank sweep moves no data: its 0 failing would prove nothing
    NAMES+=(sweep-bench) EXPECTED+=("not run at one rank") OUTCOMES+=("not run at one rank") SECS+=(0) VERDICTS+=(ok)
else
    step sweep-bench pass "$(expect sweep-bench)" -- "$PY" benchmarks/collective_sweep.py --dtype bf16 "${BENCH[@]}"
fi

tar -C "$WORK" -czf "$OUT/refs.tgz" refs 2>/dev/null
tar -C "$WORK" -czf "$OUT/logs.tgz" logs 2>/dev/null
status=0
for verdict in "${VERDICTS[@]}"; do [[ $verdict == ok ]] || status=1; done
{
    printf '%-17s %-58s %-22s %7s  %s\n' step expected outcome seconds verdict
    for i in "${!NAMES[@]}"; do
        printf '%-17s %-58s %-22s %7s  %s\n' "${NAMES[$i]}" "${EXPECTED[$i]}" "${OUTCOMES[$i]}" "${SECS[$i]}" "${VERDICTS[$i]}"
    done
    echo "mode: $( ((DRY)) && echo 'dry run (CPU)' || echo GPU), platform key $KEY, ${SECONDS}s in all," \
         "$( ((status)) && echo 'SOME STEPS DIFFER FROM THEIR EXPECTATION' || echo 'every step as expected')"
} >"$OUT/table.txt"
cat "$WORK/budget.txt" >"$OUT/budget.txt" 2>/dev/null
cat "$OUT/table.txt"
echo "results in $OUT"
rm -rf "$WORK"
exit $status

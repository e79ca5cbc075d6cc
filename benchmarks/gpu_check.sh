#!/usr/bin/env bash
# The prepared device check for a lent GPU machine: one run, results under $OUT.
#
# It uses the machine's own torch (nothing is installed: the plugin runs from this source tree
# through PYTHONPATH and -p), records a bf16 FSDP2 reference and compares against it twice
# (run-to-run determinism on the GPU), runs the collective sweep once per NCCL protocol, and
# shows an injected bf16 AVG tail fault caught on the NCCL path, and checks the kernel inventory and
# the host-op watch on real kernels. About 6 minutes on one H200.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
run() { echo "+ $*" | tee -a "$OUT/log"; "$@" 2>&1 | tail -n 40 | tee -a "$OUT/log"; }
P=(python3 -m pytest -p pytest_gpuregress.plugin -p no:cacheprovider --gpuregress --gpuregress-timeout=300 -q)

python3 -m pytest_gpuregress.cli env > "$OUT/fingerprint.json" 2>&1
run "${P[@]}" -k fsdp --gpuregress-steps=100 --gpuregress-record "--gpuregress-reference-dir=$OUT/refs"
run "${P[@]}" -k fsdp --gpuregress-steps=100 "--gpuregress-reference-dir=$OUT/refs"
run "${P[@]}" -k fsdp --gpuregress-steps=100 "--gpuregress-reference-dir=$OUT/refs"
# The kernel inventory on a real GPU: no host ops in a clean run (the failure would name them), the
# flash/efficient SDPA backend named, and a forced math backend and a real host fallback reported.
run "${P[@]}" -k "fsdp and not triage" --gpuregress-steps=100 "--gpuregress-reference-dir=$OUT/refs" \
    --gpuregress-inject=sdpa_backend:backend=math --gpuregress-lane=tolerant -W default
run "${P[@]}" -k "fsdp and not triage" --gpuregress-steps=100 "--gpuregress-reference-dir=$OUT/refs" \
    --gpuregress-inject=host_op:op=silu
python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(json.dumps({k: r['results'].get(k) for k in ('perf','host_ops')}, indent=1)); print(r['results']['kernels'].get('aten::scaled_dot_product_attention'))" \
    "$OUT/refs/fsdp/cuda-nccl-w1-bf16/record.json" 2>&1 | tee -a "$OUT/log"
run "${P[@]}" -k collectives --gpuregress-nccl-protos=LL,LL128,Simple
run "${P[@]}" -k "all_reduce and avg and bf16" \
    "--gpuregress-inject=collective:op=all_reduce,dtype=bfloat16,reduce_op=avg,mode=zero_tail,count=8"
run python3 benchmarks/collective_sweep.py --dtype bf16
tar -C "$OUT" -czf "$OUT/refs.tgz" refs 2>/dev/null
echo "results in $OUT"

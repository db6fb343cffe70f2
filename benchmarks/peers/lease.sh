#!/usr/bin/env bash
# The GPU lease's runbook. Run it again and again from the repository root; each run does the next
# call not done yet, in under 10 minutes, and says what it did and what is next:
#
#   benchmarks/peers/lease.sh [RESULTS]       # default RESULTS: tmp/lease (git-ignored)
#
# A finished call leaves RESULTS/<call>.done; a call that did not finish (killed, timed out, or
# without its table) runs again from its start. Copy RESULTS off the machine at the end (or after
# each call). The calls, in order:
#   1 7b-streamed    the Llama-2-7B shape at 0.34x of its bf16 weights (the 100B ratio), megacompile
#                    alone, 4 x 4096 tokens, measured beside the prediction under the calibrated profile;
#                    then acceptance's kernels section; the attention kernel is checked first, and
#                    where it fails the row runs unfused
#   2 3b-fsdp2       megacompile (0.34x raised to the smallest budget, and resident) vs FSDP2 CPU
#                    offload with the fused host AdamW, Llama-3.2-3B shape, 4 x 2048 tokens
#   3 deepspeed-op   DeepSpeedCPUAdam's op built, outside any timed call
#   4 3b-deepspeed   DeepSpeed ZeRO-3 offload, the same model and batches, its losses against call 2's
#   5 acceptance     acceptance's other sections (parity, budget, calibrate, step)
#   6 kernels        benchmarks/kernels/ beside torch eager, torch.compile and Liger-Kernel, one kernel
#                    at a time (each leaves RESULTS/kernels/<name>.done), as many as fit in the call
# Needs: the wheels from benchmarks/peers/wheels.sh in .whl/ (installed here into $SITE), or
# megacompile (with deepspeed and liger-kernel) installed already. The model's fp32 weights are
# written once per shape into $WEIGHTS (27 GB at 7B, removed after call 1; 14 GB at 3B), a folder
# on a disk: in a file system in RAM (tmpfs) they would sit beside the 7B run's host state, more
# than the machine's 128 GiB hold. Without WEIGHTS, the first of tmp/lease-weights in the checkout,
# /var/tmp and /tmp that is not in RAM.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
results=$(mkdir -p "${1:-$root/tmp/lease}" && cd "${1:-$root/tmp/lease}" && pwd)
python=${PYTHON:-python3}
site=${SITE:-/tmp/megacompile-site}
weights_folder() {
    local dir kind
    for dir in ${WEIGHTS:+"$WEIGHTS"} "$root/tmp/lease-weights" /var/tmp/megacompile-bench-weights \
               /tmp/megacompile-bench-weights; do
        mkdir -p "$dir" 2> /dev/null || continue
        kind=$(stat -f -c %T "$dir")
        if [ "$kind" = tmpfs ] || [ "$kind" = ramfs ]; then
            if [ "$dir" = "${WEIGHTS:-}" ]; then
                echo "WEIGHTS=$WEIGHTS is on $kind, a file system in RAM: give WEIGHTS a folder on a disk" >&2
                return 1
            fi
            continue
        fi
        (cd "$dir" && pwd)
        return 0
    done
    echo "no folder on a disk for the weights: give WEIGHTS one" >&2
    return 1
}
weights=$(weights_folder) || exit 2
profile=$root/benchmarks/results/peers-h100/h100-calibrated-profile.json
export TORCH_EXTENSIONS_DIR=$results/torch-extensions     # DeepSpeed's CPUAdam op, built once
cd "$results"     # the checkout's megacompile/ would shadow the installed package

export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
if ! $python -c "import megacompile.passes" 2> /dev/null && compgen -G "$root/.whl/*.whl" > /dev/null; then
    $python -m pip install -q --no-index --no-deps --upgrade --target "$site" "$root"/.whl/*.whl
fi

# Exit status 1 from the bench or the validation is a finding (losses that disagree, a failed
# check), written into its table like the rest; a call is done when its table is there.
bench() { $python -m megacompile.bench peers --weights "$weights" "$@" || true; }
validate() { $python -m megacompile.acceptance "$@" || true; }

call_7b_streamed() {
    rm -f 7b-streamed/peers.md 7b-streamed/kernels/validate.md
    # The attention kernel runs on a GPU for the first time here: checked first (seconds), and
    # should it fail, the row runs unfused (torch's attention) rather than not at all.
    mkdir -p 7b-streamed
    local fuse=--fuse
    if ! $python -m megacompile.kernels --check --only attention --no-compile > 7b-streamed/attention-check.txt 2>&1
    then
        fuse=--no-fuse
        echo "the attention kernel failed its check on this GPU (7b-streamed/attention-check.txt): the row runs unfused"
    fi
    bench --shape llama-7b --batch 4 --seq 4096 --warmup 1 --steps 4 --systems megacompile --budgets 0.34 \
        --host-budget 120 --profile "$profile" --minutes 7 --out 7b-streamed $fuse
    rm -rf "$weights"/llama-7b-*
    validate --skip parity,budget,calibrate,step --minutes 2 --out 7b-streamed/kernels
    [ -e 7b-streamed/peers.md ] && [ -e 7b-streamed/kernels/validate.md ]
}
call_3b_fsdp2() {
    rm -f 3b/peers.md
    bench --systems megacompile,fsdp2 --profile "$profile" --minutes 9.5 --out 3b
    [ -e 3b/peers.md ]
}
call_deepspeed_op() {
    $python -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
}
call_3b_deepspeed() {
    rm -f 3b-deepspeed/peers.md
    bench --systems deepspeed --compare-with 3b/peers.csv --minutes 9.5 --out 3b-deepspeed
    [ -e 3b-deepspeed/peers.md ]
}
call_acceptance() {
    rm -f acceptance/validate.md
    validate --skip kernels --minutes 9.5 --out acceptance
    [ -e acceptance/validate.md ]
}
call_kernels() {
    mkdir -p kernels
    local started=$SECONDS name
    for script in "$root"/benchmarks/kernels/bench_*.py; do
        name=$(basename "$script" .py)
        name=${name#bench_}
        [ -e "kernels/$name.done" ] && continue
        if (( SECONDS - started > 300 )); then     # room left for one more kernel in the 10 minutes
            echo "kernels: the rest in the next run"
            return 1
        fi
        $python "$root/benchmarks/peers/liger.py" "$name" --csv kernels/kernels.csv 2>&1 | tee "kernels/$name.log"
        touch "kernels/$name.done"
    done
}

for call in 7b-streamed 3b-fsdp2 deepspeed-op 3b-deepspeed acceptance kernels; do
    [ -e "$call.done" ] && continue
    echo "== lease call $call (results in $results)"
    started=$SECONDS
    if "call_${call//-/_}"; then
        touch "$call.done"
        echo "== $call done in $((SECONDS - started)) s; run benchmarks/peers/lease.sh again for the next call"
    else
        echo "== $call did not finish; run benchmarks/peers/lease.sh again to go on with it"
    fi
    exit 0
done
echo "== every call is done: the tables are in $results/*/peers.md, $results/*/validate.md, $results/kernels/"

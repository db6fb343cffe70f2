#!/usr/bin/env bash
# The GPU lease's runbook, sized for a lease of about 15 minutes of device time, given in commands
# of at most 10 minutes. Run it from the repository root, once per command:
#
#   LEASE_SECONDS=540 benchmarks/peers/lease.sh [CALL ...]
#
# It runs the calls not done yet, in the order below (or only the CALLs named), one after another,
# each only when its need (NEED_S below) fits in what is left of LEASE_SECONDS (default 540), so the
# command ends before its limit and no call is cut short; a call that does not fit now waits for
# the next command. A call is done when its table is there (RESULTS/<call>.done); one that did not
# finish runs again from its start. With LEASE_OUT=DIR, RESULTS is packed into
# DIR/lease.tar.gz after every call, so what a command killed at its limit measured is kept too;
# LEASE_RESUME=<that tar.gz> on a fresh machine unpacks it into RESULTS first and goes on from there.
# RESULTS is $LEASE_RESULTS, by default tmp/lease in the checkout (git-ignored). The calls, most
# important first:
#   preflight       the machine as found (GPU, driver, versions, cores, RAM, the weights' disk), seconds
#   calibrate       this machine's profile (megacompile calibrate: the GPU and its host's AdamW, which
#                   differs from one rented host to the next), which the rows are predicted under
#   7b-streamed     the Llama-2-7B shape at 0.34x of its bf16 weights (the 100B ratio), megacompile
#                   alone, 4 x 4096 tokens, beside its prediction under the calibrated profile; the
#                   attention kernel is checked on the device first, and where it fails the row runs
#                   unfused
#   3b-megacompile  the Llama-3.2-3B shape, 4 x 2048 tokens, megacompile at its smallest budget
#                   (0.34x, raised): the row the peers are set beside, and its allocator retries;
#                   then its step on fewer host AdamW threads (cores - 2, cores / 2)
#   3b-landing      the same with its host updates started as their gradients land (compile()'s
#                   updates="as_gradients_land"), its losses against 3b-megacompile's
#   3b-fsdp2        FSDP2 CPU offload with the fused host AdamW, the same model and batches, its
#                   losses against 3b-megacompile's
#   deepspeed-op    DeepSpeedCPUAdam's op built, outside any timed call
#   3b-deepspeed    DeepSpeed ZeRO-3 offload, the same model and batches
#   kernels-check   acceptance's kernels section (every kernel against torch on this GPU)
#   3b-resident     megacompile at 3B with every weight resident
#   acceptance      acceptance's other sections (parity, budget, calibrate, step)
#   kernels         benchmarks/kernels/ beside torch eager, torch.compile and Liger-Kernel, one
#                   kernel at a time (each leaves RESULTS/kernels/<name>.done), as many as fit
# Needs: the wheels from benchmarks/peers/wheels.sh in .whl/ (installed here into $SITE), or
# megacompile (with deepspeed and liger-kernel) installed already. The model's fp32 weights are
# written once per shape into $WEIGHTS (27 GB at 7B, removed after its call; 14 GB at 3B), a folder
# on a disk: in a file system in RAM (tmpfs) they would sit beside the 7B run's host state, more
# than the machine's 128 GiB hold. Without WEIGHTS, the first of lease-weights beside RESULTS
# (tmp/lease-weights in the checkout), /var/tmp and /tmp that is not in RAM.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
results=${LEASE_RESULTS:-$root/tmp/lease}
results=$(mkdir -p "$results" && cd "$results" && pwd)
python=${PYTHON:-python3}
site=${SITE:-/tmp/megacompile-site}
out=${LEASE_OUT:-}
deadline=$(( SECONDS + ${LEASE_SECONDS:-540} ))
order=(preflight calibrate 7b-streamed 3b-megacompile 3b-landing 3b-fsdp2 deepspeed-op 3b-deepspeed kernels-check 3b-resident acceptance kernels)
# Seconds each call needs: the leases' wall times (docs/gpu.md; 16 host cores) and a margin.
# Writing a shape's fp32 weights, a megacompile process's set-up (capture, plan, host state, the
# first step's kernel compiles), its steps: 7b-streamed took 278 s in the second lease; in the
# third (an H200) 3b-megacompile 164 s (the 3B weights written in it), 3b-fsdp2 122 s, deepspeed-op
# 52 s, 3b-deepspeed 101 s, kernels-check 101 s, 3b-resident 58 s; in the fourth (an H200) calibrate
# 31 s, 7b-streamed 290 s, 3b-landing 119 s (the 3B weights written in it), 3b-deepspeed 83 s.
declare -A NEED_S=([preflight]=20 [calibrate]=120 [7b-streamed]=330 [3b-megacompile]=180 [3b-landing]=120
                   [3b-fsdp2]=140 [deepspeed-op]=60 [3b-deepspeed]=130 [kernels-check]=120 [3b-resident]=75 [acceptance]=300 [kernels]=90)
# The bench calls' tables: one with no measured row (every system skipped: the log says why) is
# done but marked skipped, so the summary says so and the calls set beside it know.
declare -A TABLE=([7b-streamed]=7b-streamed [3b-megacompile]=3b [3b-landing]=3b-landing [3b-fsdp2]=3b-fsdp2
                  [3b-deepspeed]=3b-deepspeed [3b-resident]=3b-resident)
# Calls that read another's results. The peers' losses are held to 3b-megacompile's row: in a
# command that runs it too, they wait for it; named without it, they run alone (compared with it if
# an earlier command measured it), so a lease can give DeepSpeed its own first command.
declare -A AFTER=([3b-landing]=3b-megacompile [3b-fsdp2]=3b-megacompile [3b-deepspeed]="3b-megacompile deepspeed-op"
                  [3b-resident]=3b-megacompile)
for call in "$@"; do
    [ -n "${NEED_S[$call]:-}" ] || { echo "no call $call: the calls are ${order[*]}" >&2; exit 2; }
done
[ $# -gt 0 ] && order=("$@")

weights_folder() {
    local dir kind
    for dir in ${WEIGHTS:+"$WEIGHTS"} "$(dirname "$results")/lease-weights" /var/tmp/megacompile-bench-weights \
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
# The profile predicted under where no calibrate call measured this machine's: the first lease's H100.
shipped=$root/benchmarks/results/peers-h100/h100-calibrated-profile.json
export TORCH_EXTENSIONS_DIR=$results/torch-extensions     # DeepSpeed's CPUAdam op, built once
if [ -n "${LEASE_RESUME:-}" ]; then
    tar -xzf "$LEASE_RESUME" -C "$results" --skip-old-files
fi
cd "$results"     # the checkout's megacompile/ would shadow the installed package

export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
if ! $python -c "import megacompile.passes" 2> /dev/null && compgen -G "$root/.whl/*.whl" > /dev/null; then
    $python -m pip install -q --no-index --no-deps --upgrade --target "$site" "$root"/.whl/*.whl
fi

left() { echo $(( deadline - SECONDS )); }
# The profile the rows are predicted under: this machine's, measured by the calibrate call, else the shipped one.
profile() { if [ -e "$results/profile.json" ]; then echo "$results/profile.json"; else echo "$shipped"; fi; }
# --minutes for a call: what is left, at most $1 minutes.
minutes() { awk -v s="$(left)" -v cap="$1" 'BEGIN { m = s / 60 - 0.2; printf "%.2f", (m < cap ? m : cap) }'; }
pack() {
    [ -n "$out" ] || return 0
    tar -czf "$out/lease.tar.gz.part" --exclude=./torch-extensions -C "$results" . && \
        mv "$out/lease.tar.gz.part" "$out/lease.tar.gz"
}

# The peers' rows are compared with 3b-megacompile's where it measured one, else with 3b-landing's
# (the same updates, placed otherwise: the same losses).
compare() {
    local row
    for row in 3b/peers.csv 3b-landing/peers.csv; do
        if grep -q ",step_s," "$row" 2> /dev/null; then echo "--compare-with $row"; return; fi
    done
}
# Exit status 1 from the bench or the validation is a finding (losses that disagree, a failed
# check), written into its table like the rest; a call is done when its table is there.
bench() { $python -m megacompile.bench peers --weights "$weights" "$@" || true; }
validate() { $python -m megacompile.acceptance "$@" || true; }

call_preflight() {
    {
        nvidia-smi || echo "no nvidia-smi"
        $python -c "import torch, triton, transformers, megacompile; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, 'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
        $python -c "import deepspeed, liger_kernel; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1
        echo "cores $(nproc)"
        free -g
        df -h "$weights" "$results"
    } > preflight.txt 2>&1
    cat preflight.txt
    grep -q "^torch " preflight.txt
}
call_calibrate() {
    # Always measured: a shipped profile of the same card (benchmarks/results/*/*-calibrated-profile.json)
    # holds another host's AdamW rate, and a rented host's cores and memory set the streamed step's pace.
    $python -m megacompile calibrate --device cuda --out profile.json     # written whole or not at all
}
call_7b_streamed() {
    rm -f 7b-streamed/peers.md
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
        --host-budget 120 --profile "$(profile)" --minutes "$(minutes 8)" --out 7b-streamed $fuse
    rm -rf "$weights"/llama-7b-*
    [ -e 7b-streamed/peers.md ]
}
# The host AdamW thread counts the 3B row's step is timed at again after its timed steps (those run
# on every core): two cores left to the compute thread and the copies, and half the cores. The third
# lease's timed step was no faster than the step run alone, as if the updates held the next forward
# back; if fewer threads make it faster, they were contending for the host.
thread_counts() {
    local n fewer half
    n=$(nproc); fewer=$(( n > 3 ? n - 2 : 1 )); half=$(( n > 1 ? n / 2 : 1 ))
    if [ "$fewer" = "$half" ]; then echo "$fewer"; else echo "$fewer,$half"; fi
}
call_3b_megacompile() {
    rm -f 3b/peers.md
    bench --systems megacompile --budgets 0.34 --profile "$(profile)" --host-threads "$(thread_counts)" \
        --minutes "$(minutes 9.5)" --out 3b
    [ -e 3b/peers.md ]
}
call_3b_landing() {
    rm -f 3b-landing/peers.md
    bench --systems megacompile --budgets 0.34 --updates as_gradients_land --profile "$(profile)" $(compare) \
        --minutes "$(minutes 9.5)" --out 3b-landing
    [ -e 3b-landing/peers.md ]
}
call_3b_fsdp2() {
    rm -f 3b-fsdp2/peers.md
    bench --systems fsdp2 $(compare) --minutes "$(minutes 9.5)" --out 3b-fsdp2
    [ -e 3b-fsdp2/peers.md ]
}
call_deepspeed_op() {
    $python -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
}
call_3b_deepspeed() {
    rm -f 3b-deepspeed/peers.md
    bench --systems deepspeed $(compare) --minutes "$(minutes 9.5)" --out 3b-deepspeed
    [ -e 3b-deepspeed/peers.md ]
}
call_kernels_check() {
    rm -f kernels-check/validate.md
    validate --skip parity,budget,calibrate,step --minutes "$(minutes 2.5)" --out kernels-check
    [ -e kernels-check/validate.md ]
}
call_3b_resident() {
    rm -f 3b-resident/peers.md
    bench --systems megacompile --budgets resident --profile "$(profile)" $(compare) \
        --minutes "$(minutes 9.5)" --out 3b-resident
    [ -e 3b-resident/peers.md ]
}
call_acceptance() {
    rm -f acceptance/validate.md
    validate --skip kernels --minutes "$(minutes 9.5)" --out acceptance
    [ -e acceptance/validate.md ]
}
call_kernels() {
    mkdir -p kernels
    local name
    for script in "$root"/benchmarks/kernels/bench_*.py; do
        name=$(basename "$script" .py)
        name=${name#bench_}
        [ -e "kernels/$name.done" ] && continue
        if (( $(left) < ${NEED_S[kernels]} )); then
            echo "kernels: the rest in the next command"
            return 1
        fi
        $python "$root/benchmarks/peers/liger.py" "$name" --csv kernels/kernels.csv 2>&1 | tee "kernels/$name.log"
        touch "kernels/$name.done"
        pack
    done
}

ran=0
for call in "${order[@]}"; do
    [ -e "$call.done" ] && continue
    waiting=""
    for before in ${AFTER[$call]:-}; do
        if [ "$before" = 3b-megacompile ] && [[ " ${order[*]} " != *" 3b-megacompile "* ]]; then
            continue
        fi
        [ -e "$before.done" ] || waiting="$waiting $before"
    done
    if [ -n "$waiting" ]; then
        echo "== $call waits for$waiting"
        continue
    fi
    now_left=$(left)
    if (( now_left < ${NEED_S[$call]} )); then
        echo "== $call needs about ${NEED_S[$call]} s, $now_left s are left: it runs in the next command"
        continue
    fi
    echo "== lease call $call ($(left) s left; results in $results)"
    started=$SECONDS
    ran=$((ran + 1))
    if "call_${call//-/_}" 2>&1 | tee "$call.log"; then
        touch "$call.done"
        echo "== $call done in $((SECONDS - started)) s"
        if [ -n "${TABLE[$call]:-}" ] && ! grep -q ",step_s," "${TABLE[$call]}/peers.csv" 2> /dev/null; then
            touch "$call.skipped"
            echo "== $call measured nothing: every row of ${TABLE[$call]}/peers.md was skipped (its log says why)"
        fi
    else
        echo "== $call did not finish in $((SECONDS - started)) s; the next command runs it again"
    fi
    pack
done
pack
not_done=()
for call in "${order[@]}"; do
    [ -e "$call.done" ] || not_done+=("$call")
done
skipped=()
for call in "${order[@]}"; do
    [ ! -e "$call.skipped" ] || skipped+=("$call")
done
[ ${#skipped[@]} -eq 0 ] || echo "== measured nothing (every row skipped; see their logs): ${skipped[*]}"
if [ ${#not_done[@]} -eq 0 ]; then
    echo "== every call is done: the tables are in $results/*/peers.md, $results/*/validate.md, $results/kernels/"
else
    echo "== ran $ran call(s); not done yet: ${not_done[*]}"
fi

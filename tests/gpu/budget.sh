# Time budget and incremental results for tests/gpu/run.sh (sourced; tested on its own by
# tests/test_gpu_check_scripts.py). Needs START (the run's start, epoch seconds), BUDGET
# (seconds for the whole run), RES (the results folder) and, when set, OUT (the folder the
# device tool brings back).

# note MSG: print MSG with the seconds since START, and keep it in $RES/steps.log
note() { echo "[gpu-check $(( $(date +%s) - START ))s] $*" | tee -a "$RES/steps.log"; }

# allow N: the timeout for a step that wants N seconds, cut to what is left of the budget
# after 20 s kept for the summary; 0 (skip the step) when that is under 30 s
allow() {
    local want=$1 left=$(( BUDGET - 20 - ($(date +%s) - START) ))
    (( left < want )) && want=$left
    (( want < 30 )) && want=0
    echo "$want"
}

# skip NAME: say that step NAME did not run for lack of time
skip() { note "$1 skipped: too little of the ${BUDGET} s budget left"; }

# save: copy the raw results so far to $OUT, so that a run stopped from outside still brings
# back every finished step's files
save() {
    if [ -n "${OUT:-}" ]; then
        cp "$RES"/*.jsonl "$RES"/*.log "$RES"/*.json "$RES"/kernels_gpu.md "$OUT"/ 2>/dev/null
    fi
    return 0
}

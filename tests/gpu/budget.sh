# Time budget, steps and incremental results for tests/gpu/run.sh (sourced; tested on its own by
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

# save: pack the raw results so far into $OUT/raw.tar.gz, so that a run stopped from outside
# still brings back every finished step's files (the device tool brings back 8 files at most,
# so they travel as one)
save() {
    if [ -n "${OUT:-}" ]; then
        (cd "$RES" && tar -czf "$OUT/raw.tar.gz.part" --ignore-failed-read \
            $(ls *.jsonl *.log *.json *.txt kernels_gpu.md 2>/dev/null)) \
            && mv "$OUT/raw.tar.gz.part" "$OUT/raw.tar.gz"
    fi
    return 0
}

# step WANT NAME LOG LINES CMD...: run CMD with the timeout ``allow WANT`` gives (or skip it),
# its output into $RES/LOG and the last LINES of that shown; a failure sets status to 1 and
# is noted; the results so far are saved either way
step() {
    local want=$1 name=$2 log=$3 lines=$4 t rc
    shift 4
    t=$(allow "$want")
    if [ "$t" -eq 0 ]; then
        skip "$name"
    else
        note "$name"
        timeout "$t" "$@" > "$RES/$log" 2>&1
        rc=$?
        tail -"$lines" "$RES/$log"
        [ $rc -eq 0 ] || { status=1; note "$name: rc $rc"; }
    fi
    save
}

#!/usr/bin/env bash
# A run longer than one call on the offline GPU host: start it detached, then wait on it call after call.
#
#   bash scripts/gpu/detached.sh start NAME CMD [ARG...]   # CMD in a new session (setsid): it outlives this call
#   bash scripts/gpu/detached.sh wait NAME SECONDS         # until NAME ends or SECONDS pass; prints its log's tail
#
# Why: each call on the host may run 10 minutes, and whatever a call leaves running is ended when it returns, except
# a process in a session of its own, which runs until the host is given back (it stays held while calls follow each
# other). So a run of 15 minutes needs no sittings with a checkpoint between them: start it, then `wait` in one call
# after another, each within the call's limit. The run's output goes to /tmp/detached/NAME/log and, when it ends, its
# exit status to /tmp/detached/NAME/rc. `wait` exits 0 once the run has ended (its status is in the output), 3 while
# it is still running, 2 on bad usage. Each later call copies the working tree again, so a run that reads project
# files after it starts (configs, scripts) should run from a copy of them outside it, e.g. `cp -a hybridrl recipes
# examples /tmp/hrl/` first. The 1.5B recipe's three seeds ran this way (recipes/qwen25_coder_gsm_symbolic/README.md).
set -uo pipefail
ROOT=${DETACHED_ROOT:-/tmp/detached}
usage() { echo "usage: $0 start NAME CMD [ARG...] | wait NAME SECONDS" >&2; exit 2; }
[ $# -ge 2 ] || usage
verb=$1 name=$2; shift 2
dir=$ROOT/$name
case "$verb" in
    start)
        [ $# -ge 1 ] || usage
        if [ -e "$dir" ]; then echo "$dir exists: a run named $name was started already" >&2; exit 2; fi
        mkdir -p "$dir"
        # the detached shell writes its pid once in its own session (so this call may end from then on), and the
        # run's status when it ends, whether anybody waits or not
        setsid bash -c 'echo $$ > "$0/pid"; "$@" > "$0/log" 2>&1; echo $? > "$0/rc"' "$dir" "$@" \
            < /dev/null > /dev/null 2>&1 &
        for _ in $(seq 100); do [ -s "$dir/pid" ] && break; sleep 0.1; done
        [ -s "$dir/pid" ] || { echo "$name did not start within 10 s" >&2; exit 1; }
        echo "started $name: log $dir/log" ;;
    wait)
        [ $# -eq 1 ] && [[ $1 =~ ^[0-9]+$ ]] || usage
        [ -d "$dir" ] || { echo "no run named $name in $ROOT" >&2; exit 2; }
        end=$(( SECONDS + $1 ))
        # -s, not -f: the status file exists a moment before the status is in it
        while [ ! -s "$dir/rc" ] && [ $SECONDS -lt $end ]; do sleep 1; done
        tail -n 20 "$dir/log" 2>/dev/null
        if [ -s "$dir/rc" ]; then echo "$name ended with status $(cat "$dir/rc")"; exit 0; fi
        echo "$name still running"; exit 3 ;;
    *) usage ;;
esac

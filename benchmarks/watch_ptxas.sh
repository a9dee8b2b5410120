#!/usr/bin/env bash
# watch_ptxas.sh SECONDS CMD...: run CMD; every 10 s, copy the PTX input of each ptxas that has
# run for over SECONDS into $OUT/slow_ptx/ (/tmp/slow_ptx/ without $OUT; its .entry names the
# Triton kernel) and log it, so a build that stalls a start-up can be found and compiled offline.
set -u
min_age=$1; shift
out=${OUT:-/tmp}/slow_ptx
mkdir -p "$out"
"$@" &
main=$!
while kill -0 "$main" 2>/dev/null; do
  sleep 10
  ps -eo pid=,etimes=,args= | awk -v m="$min_age" '$3 ~ /ptxas$/ && $2 > m' | while read -r pid age cmd; do
    ptx=$(echo "$cmd" | tr ' ' '\n' | grep -E '\.ptx$' | head -1)
    [ -n "$ptx" ] && [ ! -e "$out/$pid.ptx" ] && cp "$ptx" "$out/$pid.ptx" 2>/dev/null \
      && echo "slow ptxas pid $pid (${age}s): $(grep -m1 -oE '\.entry [A-Za-z0-9_]+' "$ptx") $(wc -c < "$ptx") bytes"
  done
done
wait "$main"

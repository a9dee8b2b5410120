#!/usr/bin/env bash
# Keep the Triton cache a gpu_check.sh run sent back (triton_cache.tgz.* in the reply's files_at
# folder) in .tc/ (gitignored), replacing the one there, so that the next device call carries
# it: add ".tc" to the call's carry. Usage: bash benchmarks/keep_triton_cache.sh FILES_AT
set -eu
src=${1:?usage: keep_triton_cache.sh FILES_AT (the folder the device reply names)}
if ! ls "$src"/triton_cache.tgz.* >/dev/null 2>&1; then
  echo "no triton_cache.tgz.* in $src: nothing kept" >&2; exit 1
fi
cat "$src"/triton_cache.tgz.* | gzip -t || { echo "the parts in $src are not one whole archive" >&2; exit 1; }
rm -rf .tc && mkdir .tc && cp "$src"/triton_cache.tgz.* .tc/
echo "kept $(du -ch .tc/triton_cache.tgz.* | tail -1 | cut -f1) in .tc/"

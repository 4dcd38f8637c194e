#!/bin/bash
# Re-cuts the TE kit that ../shared/device/make-te.sh writes to .te/ (a core wheel in five parts of
# 56 MiB) into six parts of 46 MiB under .te/r/, with .te/te-setup6.sh to assemble them: a call
# carries at most 64 MiB with the working tree, and this tree (8 MiB of tracked files since the
# vendored cluster schemas) no longer leaves room for a 56 MiB part, nor for the last one with
# .te/small. On the GPU machine, one call after another:
#   carry [".te/r/r00", ".te/te-setup6.sh"] … [".te/r/r04", ".te/te-setup6.sh"], then
#   carry [".te/r/r05", ".te/small", ".te/te-setup6.sh"]; command `bash .te/te-setup6.sh` each time.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)/.te"
mkdir -p r
cat p00 p01 p02 p03 p04 | split -b 46M -d -a 2 - r/r
[ "$(cat r/r0? | sha256sum | cut -c1-64)" = "$(cat small/core.sha256)" ] || { echo "TE core parts do not add up to the wheel"; exit 1; }
sed -e 's#for f in .te/p0?; do#for f in .te/r/r0?; do#' -e 's#ls /tmp/te/p0?#ls /tmp/te/r0?#' -e 's#of 5"#of 6"#' \
    -e 's#-eq 5 \]#-eq 6 ]#' -e 's#cat /tmp/te/p0? >#cat /tmp/te/r0? >#' te-setup.sh > te-setup6.sh
chmod +x te-setup6.sh
ls -l r

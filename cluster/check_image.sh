#!/usr/bin/env bash
# Proves cluster/Dockerfile's layer installs on a container of NVIDIA's layout without pulling one:
#   sudo bash cluster/check_image.sh [TORCH_WHEEL]
# 1. A small base of the same layout: a Debian root (debootstrap) with the system Python and pip,
#    the distribution's "externally managed" marker kept (as on Ubuntu 24.04, under NVIDIA's
#    containers), torch and megatron-core installed system-wide as NVIDIA's containers have them.
#    TORCH_WHEEL is a CPU torch wheel for that Python (3.11 on bookworm); default: this box's file.
# 2. `docker build` of cluster/Dockerfile with BASE set to it; and over a base that pins a package
#    below what our requirements accept, which must stop with pip's conflict, never replace it.
# 3. Checks in the built image, with no network: every package the base had is still there at the
#    same version (torch and megatron-core named), our stack imports, `autotune probe` runs, and the
#    tools KubeRay's probes and `ray start` use are present.
# 4. linux/arm64 (GB200's Grace): every package the layer adds has a published aarch64 wheel
#    for the NVIDIA containers' Python (3.12), so the layer installs there without compiling.
# Needs root, a Docker daemon, debootstrap, and network to Debian's mirror and PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
torch_wheel=${1:-/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}
[ -f "$torch_wheel" ] || { echo "no torch wheel at $torch_wheel (pass one for Python 3.11 as the first argument)" >&2; exit 2; }
base_tag=autotune-smallbase:bookworm
image_tag=autotune-check:layer
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== 1. small base ($base_tag)"
debootstrap --variant=minbase --include=python3,python3-pip,ca-certificates bookworm "$work/root" \
  http://deb.debian.org/debian > "$work/debootstrap.log" 2>&1 || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
cp /etc/resolv.conf "$work/root/etc/resolv.conf"
# The host's trust store: where a TLS-intercepting proxy stands between this box and PyPI, the base
# (as a site's own image would) must trust what the host trusts.
cp /etc/ssl/certs/ca-certificates.crt "$work/root/etc/ssl/certs/ca-certificates.crt"
cp "$torch_wheel" "$work/root/tmp/"
in_root() { env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root chroot "$work/root" "$@"; }
in_root python3 -m pip install --break-system-packages --no-cache-dir -q \
  "/tmp/$(basename "$torch_wheel")" "megatron-core==0.16.1"
rm -f "$work/root/tmp/"*.whl "$work/root/etc/resolv.conf"
in_root python3 -m pip list --format=freeze > "$work/base-packages.txt"
tar -C "$work/root" -c . | docker import - "$base_tag" > /dev/null

echo "== 2. docker build --build-arg BASE=$base_tag"
docker build --network host -q -f cluster/Dockerfile --build-arg BASE="$base_tag" -t "$image_tag" .

echo "== 2b. a base that pins what our requirements refuse: the build stops, naming the conflict"
printf 'FROM %s\nRUN python3 -m pip install --break-system-packages -q --no-cache-dir "packaging==22.0"\n' "$base_tag" \
  | docker build --network host -q -t "$base_tag-old-packaging" - > /dev/null
if docker build --network host -f cluster/Dockerfile --build-arg BASE="$base_tag-old-packaging" \
     -t autotune-check:refused . > "$work/refused.log" 2>&1; then
  echo "the layer built over a base whose packaging==22.0 our packaging>=23 refuses" >&2; exit 1
fi
grep -q "The user requested (constraint) packaging==22.0" "$work/refused.log" \
  || { tail -30 "$work/refused.log" >&2; echo "the refused build did not name the conflict" >&2; exit 1; }
echo "refused, naming it: $(grep -m1 'depends on packaging' "$work/refused.log" | sed 's/^ *//')"

echo "== 3. checks in the image"
docker run --rm --network none "$image_tag" python3 -m pip list --format=freeze > "$work/image-packages.txt"
changed=$(grep -vxF -f "$work/image-packages.txt" "$work/base-packages.txt" || true)
[ -z "$changed" ] || { echo "the layer changed the base's packages:" >&2; echo "$changed" >&2; exit 1; }
echo "base packages kept: $(wc -l < "$work/base-packages.txt") ($(grep -E '^(torch|megatron-core)==' "$work/base-packages.txt" | tr '\n' ' '))"
echo "added: $(grep -vxF -f "$work/base-packages.txt" "$work/image-packages.txt" | grep -E '^(ray|optuna|moe-vlm-autotune)==' | tr '\n' ' ')"
docker run --rm --network none "$image_tag" bash -c \
  'set -e; python3 -m autotune probe > /dev/null; ray --version; command -v wget > /dev/null; echo "autotune probe, ray, wget: ok"'

echo "== 4. linux/arm64: every package the layer adds has a wheel for aarch64 and Python 3.12 on PyPI"
grep -vxF -f "$work/base-packages.txt" "$work/image-packages.txt" | grep -v '^moe-vlm-autotune==' > "$work/added.txt"
docker run --rm -i --network host -v "$work/added.txt:/added.txt:ro" "$image_tag" python3 - <<'PY'
import json, sys, urllib.request
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import Version

platforms = [f"manylinux_2_{minor}_aarch64" for minor in range(39, 16, -1)] + ["manylinux2014_aarch64"]
supported = {*cpython_tags((3, 12), platforms=platforms), *compatible_tags((3, 12), "cp312", platforms)}


def installs(filename: str, version: str) -> bool:
    try:
        _, wheel_version, _, wheel_tags = parse_wheel_filename(filename)
    except InvalidWheelFilename:  # some old releases' files predate the rules
        return False
    return wheel_version == Version(version) and bool(supported & set(wheel_tags))


missing = []
pins = [line.strip().split("==") for line in open("/added.txt") if line.strip()]
for name, version in pins:  # PyPI's simple index, in its JSON form (PEP 691)
    index = urllib.request.Request(f"https://pypi.org/simple/{canonicalize_name(name)}/",
                                   headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(index, timeout=60) as answer:
        files = [f["filename"] for f in json.load(answer)["files"] if f["filename"].endswith(".whl")]
    if not any(installs(filename, version) for filename in files):
        missing.append(f"{name}=={version}")
if missing:
    sys.exit(f"no aarch64 / Python 3.12 wheel on PyPI for: {', '.join(missing)}")
print(f"{len(pins)} added packages, each with an aarch64 / Python 3.12 wheel (or a pure-Python one)")
PY
echo "== image layer: ok"

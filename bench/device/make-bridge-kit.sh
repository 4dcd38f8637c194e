#!/bin/bash
# Builds .run/bk/{a,b,c,setup.sh} (git-ignored): the Megatron-Bridge 0.6.2 training kit for the GPU
# machine (Python 3.12, torch 2.11+cu130, no network); bench/README.md says how it travels and what
# it holds. Run from the project root on a machine with PyPI and
# a Python 3.12 (BK_PY312, default pyenv's 3.12.1) for `pip install --target`. Downloads go to /tmp/bkdl.
#   a: /tmp/bsite       (the --no-deps wheels of bench/README.md's table + HF/transformers deps)
#   b: /tmp/b6site      (megatron-bridge 0.6.2, transformers 5.12.1) + /tmp/mlm/v0.19.2 (megatron-core 0.19.2)
#   c: /tmp/bsite extras (scikit-image, scikit-learn and deps: `autotune data build` photos)
set -euo pipefail
here=$(dirname "$(readlink -f "$0")")
kit=$(git rev-parse --show-toplevel)/.run/bk
mkdir -p "$kit"
grep -qx '/.run/' "$(git rev-parse --git-dir)/info/exclude" 2>/dev/null || echo '/.run/' >> "$(git rev-parse --git-dir)/info/exclude"
PY312=${BK_PY312:-/root/.pyenv/versions/3.12.1/bin/python}
D=/tmp/bkdl; S=/tmp/bkstage
mkdir -p $D/bsite $D/b6site $D/mlm $D/extra $D/sdist
plat=(--no-deps --python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux_2_39_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
bsite=(nvidia-resiliency-ext==0.6.0 defusedxml psutil datasets==5.2.0 multiprocess dill xxhash
  megatron-energon==7.4.1 multi-storage-client==1.3.1 xattr cffi pycparser lark "wcmatch<11" bracex
  jsonschema==4.17.3 attrs pyrsistent opentelemetry-api braceexpand rapidyaml deprecation filetype webdataset
  nvidia-modelopt==0.47.0 "pulp<4" nvidia-ml-py requests urllib3 charset-normalizer idna certifi
  diffusers==0.36.0 qwen-vl-utils==0.0.14 pydantic pydantic-core annotated-types typing-inspection typing-extensions
  omegaconf==2.3.0 hydra-core==1.3.8 mistral-common pydantic-extra-types tiktoken einops
  "tokenizers>=0.22,<=0.23.0" safetensors "huggingface-hub>=1.31,<2" hf-xet httpx httpcore h11 anyio
  "fsspec<=2026.9.0" regex sentencepiece packaging pycountry)
extra=(scikit-image scikit-learn lazy-loader imageio tifffile joblib threadpoolctl cloudpickle narwhals)
for n in "${bsite[@]}"; do python3 -m pip download -q "${plat[@]}" -d $D/bsite "$n" 2>&1 | grep -v WARNING || true; done
for n in "${extra[@]}"; do python3 -m pip download -q "${plat[@]}" -d $D/extra "$n" 2>&1 | grep -v WARNING || true; done
python3 -m pip download -q "${plat[@]}" -d $D/b6site megatron-bridge==0.6.2 transformers==5.12.1 2>&1 | grep -v WARNING || true
python3 -m pip download -q "${plat[@]}" -d $D/mlm megatron-core==0.19.2 2>&1 | grep -v WARNING || true
if ! ls $D/bsite/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --no-deps --no-binary=:all: -d $D/sdist antlr4-python3-runtime==4.9.3
  python3 -m pip wheel -q --no-deps -w $D/bsite $D/sdist/antlr4-python3-runtime-4.9.3.tar.gz
fi
rm -rf $S; mkdir -p $S/mlm/v0.19.2
PF=(--no-index --no-deps --no-compile --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_39_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
for d in bsite b6site extra; do "$PY312" -m pip install -q "${PF[@]}" --target $S/$d $D/$d/*.whl; done
(cd $S/mlm/v0.19.2 && unzip -q $D/mlm/megatron_core-0.19.2-*.whl)
printf 'all:\n\t@true\n' > $S/mlm/v0.19.2/megatron/core/datasets/Makefile
rm -rf $S/bsite/pulp/solverdir/cbc/{osx,win,linux/i32,linux/arm64} $S/*/bin
find $S -name __pycache__ -prune -exec rm -rf {} +
mv $S/extra $S/extra-bsite; mkdir $S/extra; mv $S/extra-bsite $S/extra/bsite
(cd $S && tar cf - bsite | xz -T0 -9e > "$kit/a")
(cd $S && tar cf - b6site mlm | xz -T0 -9e > "$kit/b")
(cd $S/extra && tar cf - bsite | xz -T0 -9e > "$kit/c")
(cd $D && ls bsite b6site mlm extra) > "$kit/WHEELS.txt"
sums=$(cd "$kit" && sha256sum a b c)
python3 -c 'import sys; print(open(sys.argv[1]).read().replace("@SUMS@", sys.argv[2]), end="")' "$here/bridge-kit-setup.sh.in" "$sums" > "$kit/setup.sh"
ls -la "$kit"

# Sourced by the benchmarks/h200_*.sh scripts on the GPU machine: installs the carried wheels
# (.whl: what its image lacks) and this package with its C++ extension; sets OUT and B.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
B="python3 -m freetoken_jax.bench"

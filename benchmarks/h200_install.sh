# Sourced by the benchmarks/h200_*.sh scripts on the GPU machine: installs the carried wheels
# (.whl: what its image lacks) and this package with its C++ extension; sets OUT and B.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# A later call of the same lease finds it installed (/tmp/ft_installed) and skips the C++ build.
if [ ! -f /tmp/ft_installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
  touch /tmp/ft_installed
fi
export PYTHONPATH=/tmp/site
B="python3 -m freetoken_jax.bench"
